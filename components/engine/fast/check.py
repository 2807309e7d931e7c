"""The fast path checks itself against the Hugging Face forward it replaces, once when built: log-probs and
entropies on small left-padded batches (repeated prompts, a prompt that differs only in its mask, a shared prefix),
and in training mode the gradients through a repeated row. `PrefixSharedLM.for_model` returns None when a check
fails, and `grpo.policy.fast_path` falls back to the plain forward when anything raises."""

from __future__ import annotations

from typing import Any

import torch

from components.engine.fast.rows import SHARED_PREFIX_MIN
from components.engine.models.rollout import Rollout, completion_logprobs

LM = Any  # the `fastlm.PrefixSharedLM` whose pieces these functions use (not imported: it imports this module)

MAX_CHECK_LENGTH = 1024  # self-check rows are this long at most (the attention rules hold at any length)
CHECK_TOLERANCE = {torch.float32: 1e-3, torch.bfloat16: 0.1, torch.float16: 0.05}


@torch.no_grad()
def matches_reference_forward(lm: LM, vocab_size: int, prompt_length: int = 5,
                              completion_length: int = 4) -> bool:
    """Compare token log-probs and entropies with the Hugging Face forward on small left-padded batches.

    Rows 3 and 4 repeat row 0's prompt ids side by side, row 4 with another mask (a padded token made
    real), so the check fails if prompts that differ only in their mask are merged; row 1 ends early,
    so the packed forward is checked against padding too. When prompts this long can share a prefix
    worth encoding once, a second batch whose prompts share their first tokens checks that path. Both
    attention layouts (`_attention_rows`) are checked, whichever "auto" would take. The entropies depend
    on every logit.
    """
    batches = [check_batch(lm, vocab_size, prompt_length, completion_length, shared_head=0)]
    if prompt_length - 3 >= SHARED_PREFIX_MIN:
        head = max(SHARED_PREFIX_MIN, (prompt_length - 2) // 2)
        batches.append(check_batch(lm, vocab_size, prompt_length, completion_length, shared_head=head))
    was_training, chosen = lm.model.training, lm.attention_rows
    lm.model.eval()

    def agrees(batch: tuple, attention_rows: str) -> bool:
        lm.attention_rows = attention_rows
        return _agrees_with_hugging_face(lm, *batch)

    try:
        return all(agrees(batch, rows) for batch in batches for rows in ("group", "completion"))
    finally:
        lm.model.train(was_training)
        lm.attention_rows = chosen


def trains_like_reference_forward(lm: LM, vocab_size: int) -> bool:
    """One training-mode forward and backward on a small batch with a repeated row (computed once here): the
    gradients of a weighted sum of its completion log-probs must agree with the Hugging Face forward's, for
    the first and last decoder layers' trainable weights (every layer's backward lies between them). Dropout
    is off for the check only, so both forwards compute the same function."""
    prompt, mask, completion, completion_mask = check_batch(lm, vocab_size, 5, 4, shared_head=0)
    rows = torch.tensor([0, 1, 2, 3, 4, 0], device=prompt.device)  # the last row repeats the first
    checked = Rollout(prompt[rows], mask[rows], completion[rows], completion_mask[rows],
                      torch.zeros(len(rows), dtype=torch.bool, device=prompt.device))
    weights = torch.linspace(-1.0, 1.0, len(rows), device=prompt.device)[:, None] * checked.completion_mask
    layers = lm.decoder.layers
    params = [p for layer in (layers[0], layers[-1]) for p in layer.parameters() if p.requires_grad]
    if not params:
        return True  # nothing trains in those layers: nothing to compare
    was_training, rates = lm.model.training, [(m, m.p) for m in lm._dropouts]
    try:
        lm.model.train()
        for module, _ in rates:
            module.p = 0.0
        plain = completion_logprobs(lm.model, checked)[0]  # Hugging Face's forward
        expected = torch.autograd.grad((plain * weights).sum(), params)
        ours = torch.autograd.grad((lm.completion_logprobs(checked)[0] * weights).sum(), params)
    finally:
        for module, rate in rates:
            module.p = rate
        lm.model.train(was_training)
    tolerance = CHECK_TOLERANCE.get(params[0].dtype, 0.1)
    return all(_close(a, b, tolerance) for a, b in zip(ours, expected))


def check_batch(lm: LM, vocab_size: int, prompt_length: int, completion_length: int, shared_head: int):
    device = next(lm.model.parameters()).device
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, vocab_size, (3, prompt_length), generator=gen)
    mask = torch.ones_like(prompt)
    mask[1, :2] = 0
    mask[0, :1] = 0
    if shared_head:  # rows 1 and 2 start with row 0's first real tokens
        prompt[1, 2:2 + shared_head] = prompt[2, :shared_head] = prompt[0, 1:1 + shared_head]
    completion = torch.randint(0, vocab_size, (3, completion_length), generator=gen)
    prompt = torch.cat([prompt, prompt[:1], prompt[:1]])  # a repeated prompt exercises the shared path
    mask = torch.cat([mask, mask[:1], mask[:1] if shared_head else torch.ones_like(mask[:1])])
    completion = torch.cat([completion, completion[2:3], completion[1:2]])
    completion_mask = torch.ones_like(completion)
    completion_mask[1, max(1, completion_length // 2):] = 0
    return tuple(t.to(device) for t in (prompt, mask, completion, completion_mask))


def _agrees_with_hugging_face(lm: LM, prompt: torch.Tensor, mask: torch.Tensor, completion: torch.Tensor,
                              completion_mask: torch.Tensor) -> bool:
    checked = Rollout(prompt, mask, completion, completion_mask, torch.zeros(len(completion), dtype=torch.bool))
    ref_logp, ref_entropy = completion_logprobs(lm.model, checked, with_entropy=True)  # Hugging Face's forward
    logp, entropy = lm.completion_logprobs(checked, with_entropy=True)
    real = completion_mask.bool()
    error = torch.cat([(logp - ref_logp)[real], (entropy - ref_entropy)[real]]).abs()
    tolerance = CHECK_TOLERANCE.get(next(lm.model.parameters()).dtype, 0.1)
    return bool(torch.isfinite(error).all()) and float(error.max()) <= tolerance


def _close(value: torch.Tensor, expected: torch.Tensor, tolerance: float) -> bool:
    """Finite, and within `tolerance` of the expected tensor's largest magnitude."""
    error = float((value - expected).abs().max())
    return bool(torch.isfinite(value).all()) and error <= tolerance * (float(expected.abs().max()) + 1e-6)
