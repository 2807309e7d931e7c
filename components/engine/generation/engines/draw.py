"""Picking the next token from a row of logits: top-k, then top-p, at a temperature, by inverting the cumulative
distribution with one uniform per row (or the most likely token). Shared by every engine that draws on the host
side of its decode step, so engines that draw alike consume a generator alike."""

from __future__ import annotations

import torch

SAMPLE_BLOCK = 256  # tokens per block of `sample_from`'s two-level inversion


def filter_top_p(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """Mask tokens outside the smallest set whose probability reaches `top_p`."""
    sorted_logits, order = torch.sort(logits, descending=True, dim=-1)
    cumulative = torch.softmax(sorted_logits, dim=-1).cumsum(-1)
    drop_sorted = cumulative - torch.softmax(sorted_logits, dim=-1) >= top_p
    drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))


def filter_top_k(logits: torch.Tensor, top_k: int) -> torch.Tensor:
    """Mask tokens whose logit is below the k-th largest (ties with it stay, as in Hugging Face's TopKLogitsWarper)."""
    if top_k <= 0 or top_k >= logits.shape[-1]:
        return logits
    kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
    return logits.masked_fill(logits < kth, float("-inf"))


def sample_from(probs: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """One draw per row of `probs` [N, V] (rows need not sum to 1), by inverting the cumulative distribution.

    It takes N uniforms where `torch.multinomial` takes N x V exponentials. The inversion runs in two levels: which
    block of `SAMPLE_BLOCK` tokens the uniform falls in (the blocks' sums, accumulated in float64), then which token
    of that block (its own cumulative sum in float64): the same tokens as one float64 cumulative sum over the whole
    vocabulary (tests/engine/generation/engines/test_draw.py compares them), with V / SAMPLE_BLOCK + SAMPLE_BLOCK
    values summed per row instead of V. Tokens of probability 0 (top-p, top-k, the padding of the last block) are never
    drawn: their interval is empty.
    """
    n, vocab = probs.shape
    width = -(-vocab // SAMPLE_BLOCK) * SAMPLE_BLOCK
    blocks = (probs if width == vocab else torch.nn.functional.pad(probs, (0, width - vocab))).view(n, -1, SAMPLE_BLOCK)
    block_cdf = blocks.sum(-1, dtype=torch.float64).cumsum(-1)
    total = block_cdf[:, -1:].contiguous()
    target = torch.rand(total.shape, generator=generator, device=probs.device, dtype=torch.float64) * total
    block = _last_possible(block_cdf, total, torch.searchsorted(block_cdf, target, right=True))
    below = torch.where(block > 0, block_cdf.gather(-1, (block - 1).clamp(min=0)), torch.zeros_like(target))
    inside = blocks.gather(1, block[:, :, None].expand(-1, -1, SAMPLE_BLOCK)).squeeze(1).cumsum(-1, dtype=torch.float64)
    token = torch.searchsorted(inside, target - below, right=True)
    return (block * SAMPLE_BLOCK + _last_possible(inside, inside[:, -1:].contiguous(), token)).squeeze(-1)


def _last_possible(cdf: torch.Tensor, total: torch.Tensor, drawn: torch.Tensor) -> torch.Tensor:
    """`drawn`, except past the end (u * total can round up to total itself, and a block's sum and its cumulative
    sum can round apart): then the last entry of non-zero probability."""
    return torch.where(drawn >= cdf.shape[-1], torch.searchsorted(cdf, total), drawn)


def draw(logits: torch.Tensor, temperature: float, top_k: int, top_p: float,
         generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row: top-k, then top-p over what is left (Hugging Face's order), at `temperature`; and its
    log-prob under the full distribution at `temperature` (what the loss scores: the on-policy check compares)."""
    scaled = logits.float() if temperature == 1.0 else logits.float() / temperature  # no copy of [rows, V] at 1
    filtered = scaled
    if top_k > 0:
        filtered = filter_top_k(filtered, top_k)
    if top_p < 1.0:
        filtered = filter_top_p(filtered, top_p)
    probs = torch.softmax(filtered, -1)
    drawn = sample_from(probs, generator)
    if filtered is scaled:  # no filter: the softmax drawn from is the full one
        return drawn, probs.gather(-1, drawn[:, None]).squeeze(-1).log()
    return drawn, scaled.gather(-1, drawn[:, None]).squeeze(-1) - torch.logsumexp(scaled, -1)
