"""Which rows a prompt-once forward can share: a prefix every prompt has, repeated (prompt, completion) rows, whether
group rows pay, and whether a model's attention is full over a row."""

from __future__ import annotations

from typing import Any

import torch

SHARED_PREFIX_MIN = 8  # prompts sharing at least this many leading tokens encode them once (fewer: not worth a pass)


def shared_prefix_length(ids: torch.Tensor, mask: torch.Tensor) -> int:
    """How many leading real tokens all rows of left-padded `ids` share, leaving each row at least one of its own."""
    if len(ids) < 2:
        return 0
    lengths = mask.sum(-1)
    span = int(lengths.min()) - 1
    if span < 1:
        return 0
    starts = ids.shape[1] - lengths
    heads = ids.gather(1, starts[:, None] + torch.arange(span, device=ids.device))  # each row's first `span` tokens
    differs = (heads != heads[:1]).any(0)
    return int(differs.int().argmax()) if bool(differs.any()) else span


def distinct_rows(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, completion_ids: torch.Tensor,
                  completion_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Rows with the same prompt (ids and mask) and the same scored completion tokens have the same log-probs.
    Returns (first: the first row of each distinct one, in row order, so groups stay together; inverse: each
    row's index into `first`), or None when no row repeats another."""
    n = len(prompt_ids)
    if n < 2:
        return None
    scored = torch.where(completion_mask.bool(), completion_ids, -1)  # tokens past the mask never count
    key = torch.cat([prompt_ids, prompt_mask.to(prompt_ids.dtype), scored.to(prompt_ids.dtype)], dim=1)
    _, inverse = torch.unique(key, dim=0, return_inverse=True)
    distinct = int(inverse.max()) + 1
    if distinct == n:
        return None
    rows = torch.arange(n, device=key.device)
    first = torch.full((distinct,), n, device=key.device).scatter_reduce(0, inverse, rows, "amin")
    order = first.argsort()  # torch.unique sorts by value; back to row order
    rank = torch.empty_like(order)
    rank[order] = torch.arange(distinct, device=key.device)
    return first[order], rank[inverse]


def group_rows_extra_work(prompts: int, width: int, length: int, rows: int, steps: int, head_width: int) -> int:
    """Attention multiply-adds per layer (query and value side each) that rows of `length` slots per prompt
    (its `width` positions and its group's tokens) cost beyond a row per prompt plus a row per completion
    (`rows` of `steps` tokens over width + steps keys); `head_width` is query heads x head dim."""
    group_scores = prompts * length * length
    completion_scores = prompts * width * width + rows * steps * (width + steps)
    return (group_scores - completion_scores) * head_width


def full_attention(config: Any, max_length: int) -> bool:
    """Does every layer attend to every earlier token of a `max_length`-token row?

    Mistral sets `sliding_window` with no `use_sliding_window` switch; Qwen2 has the switch (off by
    default); newer configs list `layer_types` per layer. A window at least as long as the row is full.
    """
    window = getattr(config, "sliding_window", None)
    if not window or getattr(config, "use_sliding_window", True) is False or window >= max_length:
        return True
    layer_types = getattr(config, "layer_types", None)
    if layer_types:
        return all(kind == "full_attention" for kind in layer_types)
    return False
