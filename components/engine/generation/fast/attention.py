"""How the prompt-once forward's attention arranges its token list in rows, one of two ways chosen per forward:
group rows (one row per prompt holding its tokens and its group's completion tokens) or completion rows (one row
per completion over its prompt's cache). Each returns `attend(layer, heads)` over the packed token list."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from components.engine.generation.fast.pieces import ModelPieces
from components.engine.generation.fast.prompts import PromptPass, prompt_layer
from components.engine.generation.fast.rows import group_rows_extra_work

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
    return completion_rows(pieces, prompts, rows, counts, fed_rows, fed_cols)


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
                    fed_rows: torch.Tensor, fed_cols: torch.Tensor) -> Callable[[int, torch.Tensor], torch.Tensor]:
    """Attention with the prompts as rows of their own and one row per completion over its prompt's cache.

    Completion rows are cut into buckets of similar length (`length_buckets`: at most `RAGGED_CALLS` attention calls
    a layer, the cut that pads least), each padded only to its own longest row, where causality keeps real tokens
    from attending to the padding: a row that ends early (EOS) costs its own length, not the longest row's. When one
    bucket holds every row and every group has the same size G, each prompt's cache reaches its G rows by
    broadcasting (its gradient is a sum over G); otherwise rows gather it with an index (a scatter-add backward).
    """
    u, w = prompts.ids.shape
    n, device = len(rows), rows.device
    group = n // max(u, 1)
    lengths = torch.bincount(fed_rows, minlength=n)  # fed tokens per row: columns 0 .. length - 1
    buckets = [Bucket.of(members, lengths, prompts.cache_mask.bool()[rows], fed_rows, fed_cols, pieces)
               for members in length_buckets(lengths, prompts.cache_mask.shape[1])]
    broadcast = len(buckets) == 1 and len(buckets[0].rows) == n and bool((counts == group).all())
    order = torch.cat([b.tokens for b in buckets])  # the buckets' tokens, in bucket order
    back = torch.empty_like(order)
    back[order] = torch.arange(len(order), device=device)  # each packed token's place in that order
    sizes = [pieces.num_heads, pieces.num_kv_heads, pieces.num_kv_heads]

    def attend(i: int, heads: torch.Tensor) -> torch.Tensor:
        prompt_part, packed = heads.split([u * w, heads.shape[1] - u * w], dim=1)
        prompt_attn, (kp, vp) = prompt_layer(
            pieces, prompts, i, *prompt_part.unflatten(1, (u, w)).transpose(0, 1).split(sizes, dim=1))
        flat = torch.nn.functional.pad(packed.transpose(0, 1), (0, 0, 0, 0, 0, 1))  # [S + 1, h, d], a zero row last
        outs = []
        for b in buckets:
            q, k, v = flat.index_select(0, b.source).view(len(b.rows), b.width, *flat.shape[1:]).transpose(1, 2) \
                .split(sizes, dim=1)  # [n_b, h, width, d], zeros in the padding
            if broadcast:  # [U, G, H, P + S, d] -> [N, H, P + S, d]: no gather, no scatter-add in backward
                keys = torch.cat([kp[:, None].expand(-1, group, -1, -1, -1), k.unflatten(0, (-1, group))], 3)
                values = torch.cat([vp[:, None].expand(-1, group, -1, -1, -1), v.unflatten(0, (-1, group))], 3)
                keys, values = keys.flatten(0, 1), values.flatten(0, 1)
            else:
                prompt_of = rows.index_select(0, b.rows)
                keys = torch.cat([kp.index_select(0, prompt_of), k], dim=2)
                values = torch.cat([vp.index_select(0, prompt_of), v], dim=2)
            attn = pieces.merge_heads(pieces.attend(q, keys, values, b.bias))  # [n_b, width, H * d]
            outs.append(attn.flatten(0, 1).index_select(0, b.slots))
        return torch.cat([prompt_attn.flatten(0, 1), torch.cat(outs).index_select(0, back)])

    return attend


# Completion rows take at most this many attention calls a layer (buckets of similar length): more calls pad less
# but each costs an operator dispatch per layer and pass.
RAGGED_CALLS = 4


def length_buckets(lengths: torch.Tensor, key_width: int, calls: int = RAGGED_CALLS) -> list[torch.Tensor]:
    """Rows cut into at most `calls` buckets (each a tensor of row indices) of similar length, the cut whose padded
    attention work is least: a bucket costs its rows x its longest length x (`key_width` + that length) scores.
    Exact (dynamic programming over the rows sorted by length, longest first, on the CPU: a few small tensors);
    rows of length 0 are left out. The buckets are on `lengths`' device."""
    device, lengths = lengths.device, lengths.cpu()
    order = torch.argsort(lengths, descending=True, stable=True)
    order = order[lengths[order] > 0]
    m = len(order)
    if m == 0:
        return []
    longest = lengths[order].double()
    per_row = longest * (key_width + longest)  # a bucket whose longest row is this one: its cost per row
    i, j = torch.arange(m + 1, dtype=torch.double)[:, None], torch.arange(m + 1, dtype=torch.double)[None]
    cost = torch.where(j > i, (j - i) * torch.cat([per_row, per_row.new_zeros(1)])[:, None], float("inf"))
    cost.diagonal().zero_()  # an empty bucket costs nothing: "at most" `calls`
    best, cuts = cost[0], []
    for _ in range(calls - 1):  # best[j]: the least cost of the first j rows
        total = best[:, None] + cost
        best, start = total.min(0)
        cuts.append(start)
    bounds, j = {0, m}, m
    for start in reversed(cuts):  # back from the last row: where each bucket starts
        j = int(start[j])
        bounds.add(j)
    bounds = sorted(bounds)
    return [order[a:b].to(device) for a, b in zip(bounds, bounds[1:]) if b > a]


@dataclass(frozen=True)
class Bucket:
    """Completion rows attended to in one call: their packed tokens, where each sits in the bucket's [rows, width]
    grid, and the grid's mask over [prompt cache | the row's own tokens]."""

    rows: torch.Tensor  # row indices
    width: int  # the longest row's fed tokens
    tokens: torch.Tensor  # indices into the packed token list
    slots: torch.Tensor  # each of `tokens`' place in the flattened grid
    source: torch.Tensor  # each grid slot's packed token (or the zero row appended after them)
    bias: torch.Tensor  # [n_b, 1, 1, width, P + width]

    @classmethod
    def of(cls, members: torch.Tensor, lengths: torch.Tensor, cache_mask: torch.Tensor, fed_rows: torch.Tensor,
           fed_cols: torch.Tensor, pieces: ModelPieces) -> Bucket:
        device = fed_rows.device
        members = members.sort().values
        width = int(lengths[members].max())
        local = torch.full((len(lengths),), -1, dtype=torch.long, device=device)
        local[members] = torch.arange(len(members), device=device)
        tokens = (local[fed_rows] >= 0).nonzero().squeeze(1)
        slots = local[fed_rows[tokens]] * width + fed_cols[tokens]
        source = torch.full((len(members) * width,), len(fed_rows), dtype=torch.long, device=device)
        source[slots] = torch.arange(len(fed_rows), device=device)[tokens]
        causal = torch.ones(width, width, dtype=torch.bool, device=device).tril()
        keep = torch.cat([cache_mask[members][:, None, :].expand(-1, width, -1),
                          causal[None].expand(len(members), -1, -1)], dim=-1)
        return cls(members, width, tokens, slots, source,
                   pieces.bias(keep, pieces.dtype)[:, None, None])
