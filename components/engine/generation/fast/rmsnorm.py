"""RMSNorm with a two-line backward, for forwards that need a gradient.

`torch.nn.functional.rms_norm` under autograd runs on CPU as its composite: about ten operators forward
(float casts, pow, mean, add, rsqrt, two multiplies) and as many autograd nodes backward; this one is two
operators each way. Without a gradient PyTorch's own is as fast.
"""

from __future__ import annotations

import torch


class _RMSNorm(torch.autograd.Function):
    """y = x * r * w with r = (mean(x^2) + eps)^-1/2; dx = r * (g - x_hat * mean(g * x_hat)), g = dy * w."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        rstd = torch.rsqrt(x.pow(2).mean(-1, keepdim=True).add_(eps))
        x_hat = x * rstd
        ctx.save_for_backward(x_hat, rstd, weight)
        return x_hat * weight

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        x_hat, rstd, weight = ctx.saved_tensors
        grad_x = grad_weight = None
        if ctx.needs_input_grad[0]:
            g = grad_out * weight
            grad_x = (g - x_hat * (g * x_hat).mean(-1, keepdim=True)).mul_(rstd)
        if ctx.needs_input_grad[1]:
            grad_weight = (grad_out * x_hat).reshape(-1, x_hat.shape[-1]).sum(0)
        return grad_x, grad_weight, None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMS-normalise the last dim of `x` and scale by `weight` (Llama's RMSNorm), float32 with a gradient
    through `_RMSNorm`; otherwise PyTorch's `rms_norm` (half precision keeps its float32 accumulation)."""
    if torch.is_grad_enabled() and x.dtype == torch.float32 and weight.dtype == torch.float32 \
            and (x.requires_grad or weight.requires_grad):
        return _RMSNorm.apply(x, weight, eps)
    return torch.nn.functional.rms_norm(x, (x.shape[-1],), weight, eps)
