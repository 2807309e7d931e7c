"""Encoding left-padded prompts once: each layer's keys and values of every prompt token (the caches completions
attend to), with a prefix that all prompts share encoded only once."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from components.engine.generation.fast.layers import LayerWeights
from components.engine.generation.fast.pieces import ModelPieces
from components.engine.generation.fast.rows import SHARED_PREFIX_MIN, shared_prefix_length

Caches = list[tuple[torch.Tensor, torch.Tensor]]  # per layer (K, V), [U, Hkv, W, d]


@dataclass(frozen=True)
class PromptPass:
    """Left-padded prompt ids [U, P] (after a shared prefix, if any) and what attending over them needs."""

    ids: torch.Tensor
    bias: torch.Tensor  # [U, 1, 1, P, prefix + P] additive attention mask
    positions: torch.Tensor  # [U, P] rotary positions (after the prefix)
    prefix: Caches | None  # per layer (K, V) [1, Hkv, prefix, d] of the prefix all prompts share, or None
    cache_mask: torch.Tensor  # [U, prefix + P]: which cached positions are real tokens


def encode_prompts(pieces: ModelPieces, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor,
                   weights: list[LayerWeights]) -> tuple[torch.Tensor, Caches, torch.Tensor]:
    """Run left-padded prompts once: (final-normed hidden state at the last position [U, D], per-layer
    (K, V) caches [U, Hkv, W, d], cache mask [U, W]: which of the W cached positions are real tokens).

    When the prompts share their first `SHARED_PREFIX_MIN` or more real tokens (a system prompt, a chat
    template's header), that prefix is encoded once and each prompt encodes only the rest while
    attending to it; the caches then hold [prefix | padding | rest].
    """
    return encode(pieces, prompt_pass(pieces, prompt_ids, prompt_mask, weights), weights)


def prompt_pass(pieces: ModelPieces, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor,
                weights: list[LayerWeights]) -> PromptPass:
    """What a layer loop over the prompts needs; a prefix all prompts share is encoded here, once."""
    shared = shared_prefix_length(prompt_ids, prompt_mask)
    prefix = None
    ids, mask = prompt_ids, prompt_mask
    if shared >= SHARED_PREFIX_MIN:
        head = prompt_ids[:1, prompt_ids.shape[1] - int(prompt_mask[0].sum()):][:, :shared]
        prefix = encode(pieces, _prompt_pass_of(pieces, head, torch.ones_like(head), None), weights)[1]
        rest = prompt_mask.sum(-1) - shared  # real tokens after the prefix, at least 1
        width = int(rest.max())
        ids = prompt_ids[:, -width:]
        mask = (torch.arange(width, device=rest.device) >= width - rest[:, None]).to(prompt_mask.dtype)
    return _prompt_pass_of(pieces, ids, mask, prefix)


def _prompt_pass_of(pieces: ModelPieces, ids: torch.Tensor, mask: torch.Tensor, prefix: Caches | None) -> PromptPass:
    length = ids.shape[1]
    done = 0 if prefix is None else prefix[0][0].shape[2]
    causal = torch.ones(length, length, dtype=torch.bool, device=ids.device).tril()
    keep = causal[None] & mask.bool()[:, None, :]
    if done:
        keep = torch.cat([keep.new_ones(len(ids), length, done), keep], dim=-1)
    cache_mask = mask if not done else torch.cat([mask.new_ones(len(ids), done), mask], dim=1)
    return PromptPass(ids, pieces.bias(keep, pieces.dtype)[:, None, None],  # [U, 1, 1, P, done + P]
                      done + (mask.long().cumsum(-1) - 1).clamp(min=0), prefix, cache_mask)


def prompt_layer(pieces: ModelPieces, prompts: PromptPass, i: int, q: torch.Tensor, k: torch.Tensor,
                 v: torch.Tensor) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """Layer i's attention over the prompts: (output [U, P, H * d], the layer's (K, V) cache with the prefix)."""
    if prompts.prefix is not None:
        kp, vp = prompts.prefix[i]
        k = torch.cat([kp.expand(len(k), -1, -1, -1), k], dim=2)
        v = torch.cat([vp.expand(len(v), -1, -1, -1), v], dim=2)
    return pieces.merge_heads(pieces.attend(q, k, v, prompts.bias)), (k, v)


def encode(pieces: ModelPieces, prompts: PromptPass,
           weights: list[LayerWeights]) -> tuple[torch.Tensor, Caches, torch.Tensor]:
    """`encode_prompts` for a prepared pass (prompt ids after the shared prefix, if any)."""
    x = pieces.embed(prompts.ids)
    rotary = pieces.positions(x, prompts.positions)
    caches = []
    for i, (layer, fused) in enumerate(zip(pieces.layers, weights)):
        q, k, v = pieces.qkv(layer, fused, pieces.norm(layer.input_layernorm, x), rotary)
        attn, cache = prompt_layer(pieces, prompts, i, q, k, v)
        caches.append(cache)
        x = pieces.finish_layer(layer, fused, x, attn)
    return pieces.final_norm(x[:, -1, :]), caches, prompts.cache_mask
