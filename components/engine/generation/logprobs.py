"""Log-probabilities (and entropies) of chosen tokens, and `completion_logprobs`: the Hugging Face forward's log-probs
of a rollout's completion tokens, the reference every rollout engine's `logprobs` is tested against.

`log_softmax(logits).gather(tokens)` under autograd keeps the whole [rows, vocab] log-softmax, fills a
zero gradient of that size, scatters into it and runs the log-softmax backward: five passes over the
largest tensor of a step (64 x 16 x 49,152 floats for SmolLM2). `token_logprobs` keeps the log-softmax
(in place of the logits, which are then free) and its backward is one pass, `-softmax * g` plus `g` at
the chosen token. The entropy, a logged statistic, is a batched dot product of the same log-softmax
with its exponent, without a gradient. (`log_softmax` rather than `logsumexp`, which PyTorch composes from five
passes, and the dot product as `bmm`: the measurements are in docs/performance.md.)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from components.engine.generation.rollouts import Turn, positions_from_mask


class _TokenLogProbs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: torch.Tensor, tokens: torch.Tensor, with_entropy: bool):
        log_probs = torch.log_softmax(logits, dim=-1)
        logp = log_probs.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
        if with_entropy:  # H = -sum(p * log p)
            entropy = -torch.bmm(log_probs.exp().unsqueeze(1), log_probs.unsqueeze(2)).view(-1)
        else:
            entropy = logits.new_empty(0)
        ctx.save_for_backward(log_probs, tokens)
        ctx.mark_non_differentiable(entropy)
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp: torch.Tensor, _grad_entropy: torch.Tensor):
        log_probs, tokens = ctx.saved_tensors
        grad = log_probs.exp()  # softmax
        grad.mul_(-grad_logp.unsqueeze(-1))
        grad.scatter_add_(-1, tokens.unsqueeze(-1), grad_logp.unsqueeze(-1))
        return grad, None, None


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor,
                   with_entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log softmax(logits)[token] for each row of `logits` [..., V] and `tokens` [...], computed in at least
    float32; with `with_entropy`, also each row's entropy in nats (no gradient)."""
    shape = tokens.shape
    flat = logits.reshape(-1, logits.shape[-1])
    if flat.dtype in (torch.float16, torch.bfloat16):
        flat = flat.float()
    logp, entropy = _TokenLogProbs.apply(flat, tokens.reshape(-1), with_entropy)
    return logp.view(shape), (entropy.view(shape) if with_entropy else None)


# Logits of all completion tokens at once are kept while they take at most this much memory; beyond it they are
# computed `LOGITS_CHUNK_BYTES` at a time (forward, and again in backward), so memory stops growing with
# tokens x vocabulary. SmolLM2 (49,152 tokens): 1,365 rows at once, chunks of 341 rows.
LOGITS_BUDGET_BYTES = 256 * 2**20
LOGITS_CHUNK_BYTES = 64 * 2**20


def logit_chunk_rows(rows: int, vocab_size: int) -> int:
    """Rows of [rows, vocab] float32 logits computed at once: all of them within the budget, else a chunk's worth."""
    if rows * vocab_size * 4 <= LOGITS_BUDGET_BYTES:
        return max(rows, 1)
    return max(1, LOGITS_CHUNK_BYTES // (4 * vocab_size))


def _chunk_logprobs(head: Callable[[torch.Tensor], torch.Tensor], hidden: torch.Tensor, tokens: torch.Tensor,
                    with_entropy: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """A head with its own `token_logprobs` (fast/head.py `LinearHead`: one vocabulary-wide buffer) computes them;
    any other head gives its logits to `token_logprobs`."""
    fused = getattr(head, "token_logprobs", None)
    logp, entropy = fused(hidden, tokens, with_entropy) if fused else token_logprobs(head(hidden), tokens, with_entropy)
    return logp, (entropy if with_entropy else logp.new_empty(0))


def head_token_logprobs(head: Callable[[torch.Tensor], torch.Tensor], hidden: torch.Tensor, tokens: torch.Tensor,
                        vocab_size: int, with_entropy: bool = False,
                        chunk_rows: int | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`token_logprobs(head(hidden), tokens)` for hidden states [R, D] and tokens [R], without logits for all R rows.

    The loss needs one log-prob per token, not the vocabulary: rows go through `head` (the vocabulary head, any
    temperature folded in) `chunk_rows` at a time (default `logit_chunk_rows`). With a gradient each chunk is
    recomputed in backward (`torch.utils.checkpoint`), so only the hidden states are kept: the idea of Liger's
    fused linear cross-entropy, in plain PyTorch, for any head module (tied, biased, hooked). Within the budget
    it is exactly `token_logprobs(head(hidden), tokens)`.
    """
    rows = hidden.shape[0]
    size = chunk_rows or logit_chunk_rows(rows, vocab_size)
    if rows <= size:
        logp, entropy = _chunk_logprobs(head, hidden, tokens, with_entropy)
        return logp, (entropy if with_entropy else None)
    from torch.utils.checkpoint import checkpoint

    recompute = torch.is_grad_enabled() and (hidden.requires_grad or any(
        p.requires_grad for p in getattr(head, "parameters", lambda: [])()))
    parts = []
    for h, t in zip(hidden.split(size), tokens.split(size)):
        if recompute:
            parts.append(checkpoint(_chunk_logprobs, head, h, t, with_entropy, use_reentrant=False))
        else:
            parts.append(_chunk_logprobs(head, h, t, with_entropy))
    logp = torch.cat([lp for lp, _ in parts])
    return logp, (torch.cat([e for _, e in parts]) if with_entropy else None)


def decoder_and_head(model) -> tuple[Any, Any] | None:
    """(the decoder stack, the vocabulary head) of a Hugging Face causal LM (or a peft model over one) whose logits
    are exactly `head(decoder(...).last_hidden_state)`; None for wrappers (DDP, FSDP2), whose forward must be the
    wrapper's, and for models that post-process their logits (soft-capping, logit scales)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    if isinstance(base, torch.nn.parallel.DistributedDataParallel) or hasattr(base, "reshard"):
        return None
    config = getattr(base, "config", None)
    if config is None or getattr(config, "final_logit_softcapping", None) or getattr(config, "logit_scale", None):
        return None
    get_decoder, get_head = getattr(base, "get_decoder", None), getattr(base, "get_output_embeddings", None)
    decoder, head = (get_decoder() if get_decoder else None), (get_head() if get_head else None)
    if decoder is None or head is None or decoder is base:
        return None
    return decoder, head


def completion_logprobs(model, rollouts: Turn, temperature: float = 1.0,
                        with_entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-token log-probs [N, T] of the completion tokens under `model` (logits scaled by temperature),
    and with `with_entropy` the entropy [N, T] of each next-token distribution (no gradient).

    Where the model allows it (`decoder_and_head`) only the completion positions go through the vocabulary
    head, in chunks (`head_token_logprobs`); otherwise the model's own forward gives every position's logits."""
    attention = rollouts.attention_mask
    inputs = dict(input_ids=rollouts.input_ids, attention_mask=attention, position_ids=positions_from_mask(attention),
                  use_cache=False)
    prompt_len, comp_len = rollouts.prompt_ids.shape[1], rollouts.completion_ids.shape[1]
    parts = decoder_and_head(model)
    if parts is None:
        logits = model(**inputs).logits[:, prompt_len - 1: prompt_len - 1 + comp_len, :].float()
        if temperature != 1.0:
            logits = logits / temperature
        return token_logprobs(logits, rollouts.completion_ids, with_entropy)
    decoder, head = parts
    hidden = decoder(**inputs).last_hidden_state[:, prompt_len - 1: prompt_len - 1 + comp_len, :]

    def logits(h: torch.Tensor) -> torch.Tensor:
        out = head(h).float()
        return out / temperature if temperature != 1.0 else out

    n = rollouts.completion_ids.shape[0]
    logp, entropy = head_token_logprobs(
        logits, hidden.reshape(n * comp_len, -1), rollouts.completion_ids.reshape(-1),
        getattr(head, "out_features", None) or decoder.get_input_embeddings().num_embeddings, with_entropy)
    return logp.view(n, comp_len), (entropy.view(n, comp_len) if with_entropy else None)
