"""The optimizer and learning-rate schedule every training of these models uses (SFT and GRPO): AdamW over the
trainable parameters, and linear warmup then cosine decay to a floor."""

from __future__ import annotations

import math

import torch


def make_optimizer(model: torch.nn.Module, learning_rate: float, weight_decay: float, device: torch.device,
                   fused: bool = True) -> torch.optim.Optimizer:
    """AdamW over the trainable parameters (the LoRA adapters alone with LoRA); with `fused`, one fused update of
    every tensor where the device has the kernel (faster per step, rounding slightly differently from the
    per-tensor loop, which SFT keeps so its warm starts stay those already recorded)."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    fused = fused and device.type in ("cpu", "cuda") and all(p.is_floating_point() for p in trainable)
    return torch.optim.AdamW(trainable, lr=learning_rate, weight_decay=weight_decay, fused=fused or None)


def cosine_learning_rate(step: int, total_steps: int, peak: float, warmup_steps: int = 0,
                         floor_ratio: float = 0.0) -> float:
    """Linear warmup to `peak` over `warmup_steps`, then cosine decay to `floor_ratio` of it at `total_steps`."""
    if step < warmup_steps:
        return peak * (step + 1) / warmup_steps
    progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
    cosine = 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))
    return peak * (floor_ratio + (1.0 - floor_ratio) * cosine)


def set_learning_rate(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr
