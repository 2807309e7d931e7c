"""How the prompt-once forward's attention arranges its token list in rows, one of two ways chosen per forward:
group rows (one row per prompt holding its tokens and its group's completion tokens) or completion rows (one row
per completion over its prompt's cache). Each returns `attend(layer, heads)` over the packed token list."""

from __future__ import annotations

from collections.abc import Callable

import torch

from components.engine.fast.pieces import ModelPieces
from components.engine.fast.prompts import PromptPass, prompt_layer
from components.engine.fast.rows import group_rows_extra_work

# Group rows while the attention multiply-adds they add per layer stay under this (measured: docs/performance.md).
GROUP_ROWS_EXTRA_WORK = 4_000_000


def attention_rows(pieces: ModelPieces, prompts: PromptPass, rows: torch.Tensor, counts: torch.Tensor,
                   fed_rows: torch.Tensor, fed_cols: torch.Tensor,
                   steps: int) -> Callable[[int, torch.Tensor], torch.Tensor]:
    """Layer i's attention over the token list: `attend(i, heads [H + 2 Hkv, U*W + S, d])` -> [U*W + S, H * d].

    Group rows (`group_rows`): one row per prompt holding its tokens and all its group's completion
    tokens; fewer operator calls on small models, but each row's scores are a square over prompt + G
    completions. Completion rows (`completion_rows`): one row per completion over its prompt's cache;
    the least attention work. `attention_rows` "auto" takes group rows while the scores they add stay
    under `GROUP_ROWS_EXTRA_WORK` multiply-adds a layer (never with a shared prefix).
    """
    u, w = prompts.ids.shape
    per_group = torch.bincount(rows[fed_rows], minlength=u)  # packed tokens of each prompt's group
    length = w + int(per_group.max())
    extra = group_rows_extra_work(u, w, length, len(rows), steps, pieces.num_heads * pieces.head_dim)
    if prompts.prefix is None and (pieces.options.attention_rows == "group"
                                   or pieces.options.attention_rows == "auto" and extra <= GROUP_ROWS_EXTRA_WORK):
        return group_rows(pieces, prompts, rows, per_group, length, fed_rows, fed_cols)
    return completion_rows(pieces, prompts, rows, counts, fed_rows, fed_cols, steps)


def group_rows(pieces: ModelPieces, prompts: PromptPass, rows: torch.Tensor, per_group: torch.Tensor, length: int,
               fed_rows: torch.Tensor, fed_cols: torch.Tensor) -> Callable[[int, torch.Tensor], torch.Tensor]:
    """Attention in one row of `length` slots per prompt: its W positions, then its group's packed tokens.

    A key is visible to a query when it comes no later (`order`: prompt position, or W + completion
    column) and is either a real prompt token or a token of the same completion (`owner`). One gather
    puts the token list into the [U, length] grid (empty slots read an appended zero row), one gather
    takes the outputs back.
    """
    u, w = prompts.ids.shape
    device = rows.device
    group_of = rows[fed_rows]
    within = torch.arange(len(fed_rows), device=device) - (per_group.cumsum(0) - per_group)[group_of]
    prompt_slots = (torch.arange(u, device=device)[:, None] * length + torch.arange(w, device=device)).flatten()
    slot = torch.cat([prompt_slots, group_of * length + w + within])  # each listed token's place in the grid
    source = torch.full((u * length,), len(slot), dtype=slot.dtype, device=device)
    source[slot] = torch.arange(len(slot), device=device)
    real = prompts.cache_mask.bool()
    owner = torch.full((u, length), -2, dtype=torch.long, device=device)  # -2: an empty slot
    owner[:, :w] = torch.where(real, -1, -3)  # -1: a real prompt token, -3: left padding
    owner.view(-1)[slot[u * w:]] = fed_rows
    order = torch.full((u, length), length + w, dtype=torch.long, device=device)
    order[:, :w] = torch.arange(w, device=device)
    order.view(-1)[slot[u * w:]] = w + fed_cols
    same_owner = owner[:, None, :] == owner[:, :, None]
    keep = (order[:, None, :] <= order[:, :, None]) & ((owner[:, None, :] == -1) | same_owner)
    bias = pieces.bias(keep, pieces.dtype)[:, None, None]  # [U, 1, 1, L, L]
    sizes = [pieces.num_heads, pieces.num_kv_heads, pieces.num_kv_heads]

    def attend(_i: int, heads: torch.Tensor) -> torch.Tensor:
        flat = torch.nn.functional.pad(heads.transpose(0, 1), (0, 0, 0, 0, 0, 1))  # [T + 1, h, d]
        q, k, v = flat.index_select(0, source).view(u, length, *flat.shape[1:]).transpose(1, 2).split(sizes, 1)
        return pieces.merge_heads(pieces.attend(q, k, v, bias)).flatten(0, 1).index_select(0, slot)

    return attend


def completion_rows(pieces: ModelPieces, prompts: PromptPass, rows: torch.Tensor, counts: torch.Tensor,
                    fed_rows: torch.Tensor, fed_cols: torch.Tensor,
                    steps: int) -> Callable[[int, torch.Tensor], torch.Tensor]:
    """Attention with the prompts as rows of their own and one row per completion over its prompt's cache.

    Completion tokens are padded per row ([N, steps]), where causality keeps real tokens from
    attending to the padding. When every group has the same size G, each prompt's cache reaches its G
    rows by broadcasting (its gradient is a sum over G); otherwise rows gather it with an index (a
    scatter-add backward).
    """
    u, w = prompts.ids.shape
    n, device = len(rows), rows.device
    group = n // max(u, 1)
    even = bool((counts == group).all())
    place = fed_rows * steps + fed_cols  # each packed token's slot in the padded [N, steps] grid
    causal = torch.ones(steps, steps, dtype=torch.bool, device=device).tril()
    keep = torch.cat([prompts.cache_mask.bool()[rows][:, None, :].expand(-1, steps, -1),
                      causal[None].expand(n, -1, -1)], dim=-1)
    bias = pieces.bias(keep, pieces.dtype)[:, None, None]  # [N, 1, 1, steps, P + steps]
    # each slot of the padded [N, steps] grid: its packed token, or the zero row appended after them
    source = torch.full((n * steps,), len(place), dtype=place.dtype, device=device)
    source[place] = torch.arange(len(place), device=device)
    sizes = [pieces.num_heads, pieces.num_kv_heads, pieces.num_kv_heads]

    def unpack(t: torch.Tensor) -> torch.Tensor:  # [h, S, d] -> [N, h, steps, d], zeros in the padding
        flat = torch.nn.functional.pad(t.transpose(0, 1), (0, 0, 0, 0, 0, 1))  # one pass writes the grid
        return flat.index_select(0, source).view(n, steps, *flat.shape[1:]).transpose(1, 2)

    def attend(i: int, heads: torch.Tensor) -> torch.Tensor:
        prompt_part, packed = heads.split([u * w, heads.shape[1] - u * w], dim=1)
        prompt_attn, (kp, vp) = prompt_layer(
            pieces, prompts, i, *prompt_part.unflatten(1, (u, w)).transpose(0, 1).split(sizes, dim=1))
        q, k, v = unpack(packed).split(sizes, dim=1)
        if even:  # [U, G, H, P + S, d] -> [N, H, P + S, d]: no gather, no scatter-add in backward
            keys = torch.cat([kp[:, None].expand(-1, group, -1, -1, -1), k.unflatten(0, (-1, group))], 3)
            values = torch.cat([vp[:, None].expand(-1, group, -1, -1, -1), v.unflatten(0, (-1, group))], 3)
            keys, values = keys.flatten(0, 1), values.flatten(0, 1)
        else:
            keys = torch.cat([kp.index_select(0, rows), k], dim=2)
            values = torch.cat([vp.index_select(0, rows), v], dim=2)
        attn = pieces.merge_heads(pieces.attend(q, keys, values, bias))  # [N, steps, H * d]
        return torch.cat([prompt_attn.flatten(0, 1), attn.flatten(0, 1).index_select(0, place)])

    return attend
