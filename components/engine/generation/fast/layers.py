"""The fast path's pieces of a decoder layer: rotary embeddings (also as a complex rotation over paired q|k rows),
fused q|k|v weights, and a projection as a plain (weight, bias) matmul where the module allows it (LoRA merged
without a gradient)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return x * cos + _rotate_half(x) * sin


def _paired_rows(t: torch.Tensor, heads: int) -> torch.Tensor:
    """A view of a projection's weight [heads * d, ...] (or bias) as [heads, d/2, 2, ...]: dims i and i + d/2 of
    each head side by side, so that the row order [0, d/2, 1, d/2 + 1, ...] costs nothing beyond the fusing cat."""
    return t.unflatten(0, (heads, 2, -1)).transpose(1, 2)


def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, paired_heads: tuple[int, int] | None) -> torch.Tensor:
    """q|k|v weights (or biases) in one tensor; with `paired_heads` (query heads, key/value heads) the q and k
    rows are paired for complex rotation, in the same single copy."""
    if paired_heads is None:
        return torch.cat([q, k, v])
    heads, kv_heads = paired_heads
    paired = [_paired_rows(q, heads), _paired_rows(k, kv_heads), v.unflatten(0, (kv_heads, -1, 2))]
    return torch.cat(paired).flatten(0, 2)


class Rotary:
    """One forward's rotary embedding: cos/sin [B, 1, L, d]; e^(i*theta) [B, 1, L, d/2] made on first use."""

    def __init__(self, cos: torch.Tensor, sin: torch.Tensor):
        self.cos, self.sin = cos, sin
        self._turn: torch.Tensor | None = None

    @property
    def turn(self) -> torch.Tensor:
        if self._turn is None:
            half = self.cos.shape[-1] // 2
            self._turn = torch.complex(self.cos[..., :half], self.sin[..., :half])
        return self._turn

    def at(self, offset: int) -> Rotary:
        """The rotation of one decoding position (all positions are computed once per decoding run)."""
        return Rotary(*(t[:, :, offset:offset + 1] for t in (self.cos, self.sin)))

    def select(self, rows: torch.Tensor) -> Rotary:
        """The given rows' rotations."""
        return Rotary(self.cos.index_select(0, rows), self.sin.index_select(0, rows))

    def of_layer(self, layer: Any) -> Rotary:
        """The rotation a decoder layer applies: one table for every layer."""
        return self


class LayerTypeRotary:
    """One forward's rotary embeddings when each attention type has its own table (Gemma 3: local and global layers
    rotate with different bases): a `Rotary` per type, each layer taking its own type's."""

    def __init__(self, tables: dict[str, Rotary]):
        self.tables = tables

    def at(self, offset: int) -> LayerTypeRotary:
        return LayerTypeRotary({kind: r.at(offset) for kind, r in self.tables.items()})

    def select(self, rows: torch.Tensor) -> LayerTypeRotary:
        return LayerTypeRotary({kind: r.select(rows) for kind, r in self.tables.items()})

    def of_layer(self, layer: Any) -> Rotary:
        return self.tables[layer.self_attn.layer_type]


Linear = tuple[torch.Tensor, "torch.Tensor | None"]  # (weight, bias) of a projection used as a plain matmul


@dataclass
class LayerWeights:
    """One decoder layer's projections as plain matmuls; None where the module must be called itself."""

    qkv: tuple[torch.Tensor, torch.Tensor | None, bool] | None  # fused q|k|v weight, bias, q|k rows paired
    o: Linear | None
    gate_up: tuple[torch.Tensor, torch.Tensor] | None  # gate and up weights (no bias), two matmuls
    down: Linear | None


def _dense(weight: torch.Tensor) -> bool:
    return type(weight) in (torch.Tensor, torch.nn.Parameter)


def plain_linear(module: Any, merge_lora: bool = False) -> Linear | None:
    """(weight, bias) such that F.linear(x, weight, bias) == module(x), or None.

    A plain `nn.Linear` gives its own. With `merge_lora`, a peft LoRA `Linear` over a plain one gives
    W + sum of s * B @ A over its active adapters (W alone while they are disabled): only for vanilla
    LoRA without dropout or a bias on B, and not while merged into W (the module then handles it).
    A quantized frozen weight (a tensor subclass such as torchao's NF4) is dequantized with `merge_lora` and
    otherwise left to the module (its own `F.linear` dequantizes as it goes).
    """
    if type(module) is torch.nn.Linear:
        if _dense(module.weight):
            return module.weight, module.bias
        return (module.weight.to(module.weight.dtype), module.bias) if merge_lora else None
    base = getattr(module, "base_layer", None)
    if not merge_lora or type(base) is not torch.nn.Linear or not hasattr(module, "get_delta_weight") \
            or getattr(module, "merged", True):
        return None
    weight = base.weight if _dense(base.weight) else base.weight.to(base.weight.dtype)
    if module.disable_adapters:
        return weight, base.bias
    for name in module.active_adapters:
        if name not in module.lora_A:
            continue
        if name in getattr(module, "lora_variant", {}) or type(module.lora_dropout[name]) is not torch.nn.Identity \
                or module.lora_B[name].bias is not None:
            return None
        # peft keeps the adapters of a bfloat16 or float16 model in float32: the sum stays in the model's dtype
        weight = weight + module.get_delta_weight(name).to(weight.dtype)
    return weight, base.bias
