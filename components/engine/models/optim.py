"""The optimizer and learning-rate schedule every training of these models uses (SFT and GRPO): AdamW over the
trainable parameters, and linear warmup then cosine decay to a floor."""

from __future__ import annotations

import math

import torch

HALF = (torch.bfloat16, torch.float16)


def make_optimizer(model: torch.nn.Module, learning_rate: float, weight_decay: float, device: torch.device,
                   fused: bool = True) -> torch.optim.Optimizer:
    """AdamW over the trainable parameters (the LoRA adapters alone with LoRA); with `fused`, one fused update of
    every tensor where the device has the kernel (faster per step, rounding slightly differently from the
    per-tensor loop, which SFT keeps so its warm starts stay those already recorded).

    Trainable weights in bfloat16 or float16 (full fine-tuning of a half-precision model, e.g. `model.dtype: auto`
    on a GPU) train through float32 master weights (`MasterWeightAdamW`): the forwards, backwards and decoding stay
    in half precision, the update is float32. Sharded (FSDP2) weights keep their own dtype."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    fused = fused and device.type in ("cpu", "cuda") and all(p.is_floating_point() for p in trainable)
    cls = torch.optim.AdamW
    if any(p.dtype in HALF for p in trainable) and not any(type(p).__name__ == "DTensor" for p in trainable):
        cls = MasterWeightAdamW
    return cls(trainable, lr=learning_rate, weight_decay=weight_decay, fused=fused or None)


class MasterWeightAdamW(torch.optim.AdamW):
    """AdamW whose state and weights are float32 copies of half-precision parameters (mixed precision's master
    weights): `step` takes the parameters' gradients in float32, updates the copies, and writes them back rounded.

    Without it an update smaller than half a unit in the last place (bfloat16 keeps 8 significant bits: `2**-8` of a
    weight; a learning rate of `1e-5` moves a weight of `0.01` by `1e-3` of itself) is rounded away on every step.
    Costs 4 bytes a trainable parameter beyond plain AdamW's 8. Parameters already in float32 are updated in place as
    plain AdamW would. `state_dict` carries the copies (`master_weights`), so a resumed run continues from the
    float32 values."""

    def __init__(self, params, **options):
        self.model_params = list(params)
        masters = [p.detach().float() if p.dtype in HALF else p for p in self.model_params]
        super().__init__(masters, **options)

    @property
    def masters(self) -> list[torch.Tensor]:
        return [p for group in self.param_groups for p in group["params"]]

    @torch.no_grad()
    def step(self, closure=None):
        pairs = [(p, m) for p, m in zip(self.model_params, self.masters) if m is not p]
        for p, m in pairs:
            m.grad = None if p.grad is None else p.grad.float()
        loss = super().step(closure)
        for p, m in pairs:
            p.copy_(m)
            m.grad = None
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.model_params:
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad.zero_()

    def state_dict(self):
        return {**super().state_dict(), "master_weights": [m.detach().clone() for m in self.masters]}

    @torch.no_grad()
    def load_state_dict(self, state_dict) -> None:
        state = dict(state_dict)
        saved = state.pop("master_weights", None)
        super().load_state_dict(state)
        for p, m, value in zip(self.model_params, self.masters, saved or [p.float() for p in self.model_params]):
            m.copy_(value)
            p.copy_(m)


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
