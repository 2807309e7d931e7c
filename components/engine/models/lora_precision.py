"""LoRA adapters applied in the model's precision and kept in float32 for the optimizer.

peft keeps a bfloat16 or float16 model's adapters in float32 and casts every adapted projection's input to a float32
copy, which autograd saves for the backward: a float32 activation per adapted projection and token (hidden size x
4 bytes), more than the half-precision input it copies. Here each adapter matrix applies its weight cast to the
input's dtype instead (`InputDtypeLinear`): the input is not copied, the cast copies an r x d weight, and the
parameters, their gradients and the optimizer's updates stay float32, so small updates are not rounded away. A
float32 model is left as it is (nothing to cast). Gradients then round as the model's own half-precision products do
(tests/engine/models/test_lora_precision.py holds them to the fast path's half-precision rule).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

HALF_PRECISION = (torch.bfloat16, torch.float16)


class InputDtypeLinear(torch.nn.Linear):
    """An adapter matrix in its own dtype, applied in its input's: `x @ W.to(x.dtype).T`."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = None if self.bias is None else self.bias.to(x.dtype)
        return F.linear(x, self.weight.to(x.dtype), bias)


def adapters_in_model_dtype(model: Any) -> int:
    """Every peft LoRA layer over a half-precision base applies its adapters in that precision (its A and B become
    `InputDtypeLinear`, peft's input cast off); the number of layers changed (0 for a float32 model)."""
    changed = 0
    for module in model.modules():
        base = getattr(module, "base_layer", None)
        if not hasattr(module, "lora_A") or not hasattr(module, "cast_input_dtype_enabled") or base is None \
                or getattr(base, "weight", None) is None or base.weight.dtype not in HALF_PRECISION:
            continue
        for name in module.lora_A:
            for adapter in (module.lora_A[name], module.lora_B[name]):
                if type(adapter) is torch.nn.Linear:
                    adapter.__class__ = InputDtypeLinear
        module.cast_input_dtype_enabled = False
        changed += 1
    return changed
