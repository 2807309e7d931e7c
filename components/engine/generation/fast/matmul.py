"""`linear`: F.linear on oneDNN's kernels for large float32 products on the CPU, with a two-product backward.

PyTorch sends float32 matrix products on the CPU to MKL's sgemm, which picks its kernels by CPU vendor:
on AMD processors with AVX-512 (Zen 4, Zen 5) it runs its AVX2 code. oneDNN, also inside PyTorch
(`torch.ops.mkldnn._linear_pointwise`), picks by instruction set, so it runs AVX-512 there, forward and backward
(grad . W and grad^T . x, read as strided views). Each oneDNN call costs more to start, so small
products lose: `ONEDNN_MIN_WORK` sends only products of 8M multiply-adds or more. Both sum in float32; only the
order of the sums, so the rounding, differs. On Intel processors MKL already runs AVX-512 kernels.

oneDNN compiles a kernel per shape the first time it meets it and caches it. Row counts change every step
(packed tokens, finished rows), so rows are padded up to a few sizes per power of two (`padded_rows`), and a run
meets a few dozen shapes. The figures behind these choices: docs/performance.md ("oneDNN for large products").
"""

from __future__ import annotations

import torch

ONEDNN_MIN_WORK = 1 << 23  # multiply-adds (rows x in x out) from which a product goes to oneDNN
ONEDNN_ROW_STEP = 16  # rows are padded up to a multiple of this, or of 1/16 of their power of two if larger
ONEDNN_BUILT = torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")
_onednn_works: bool | None = None  # probed on first use (`onednn_usable`)


def padded_rows(rows: int) -> int:
    """The row count a product of `rows` rows runs at (at most 1/16 more from 256 rows, 15 more below), so that a run
    meets a few dozen shapes, each compiled once, instead of one per row count."""
    step = max(ONEDNN_ROW_STEP, 1 << max(rows.bit_length() - 5, 0))
    return -(-rows // step) * step


def pad_rows(rows: torch.Tensor, count: int) -> torch.Tensor:
    """`rows` [R, n] with zero rows appended up to `count` (the same tensor when it has them already)."""
    return rows if len(rows) == count else torch.nn.functional.pad(rows, (0, 0, 0, count - len(rows)))


def onednn_product(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [rows, in] . weight [out, in]^T (+ bias) on oneDNN; strided views are read as they are."""
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


def _padded_product(x: torch.Tensor, weight: torch.Tensor,
                    bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., in] . weight^T (+ bias) run at `padded_rows`: (the output [..., out], the padded rows [R, in])."""
    flat = x.reshape(-1, x.shape[-1])
    padded = pad_rows(flat, padded_rows(len(flat)))
    return onednn_product(padded, weight, bias)[:len(flat)].view(*x.shape[:-1], weight.shape[0]), padded


class _Linear(torch.autograd.Function):
    """y = x W^T + b; dx = dy W, dW = dy^T x, db = sum of dy: each product one oneDNN call at the padded rows
    (zero rows add nothing to dW)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        out, padded = _padded_product(x, weight, bias)
        ctx.save_for_backward(padded, weight)
        ctx.has_bias, ctx.shape = bias is not None, x.shape
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        padded, weight = ctx.saved_tensors
        grad_x = grad_weight = grad_bias = None
        rows = grad.reshape(-1, grad.shape[-1])
        grad_padded = pad_rows(rows, len(padded))
        if ctx.needs_input_grad[0]:
            grad_x = onednn_product(grad_padded, weight.t())[:len(rows)].view(ctx.shape)
        if ctx.needs_input_grad[1]:
            grad_weight = onednn_product(grad_padded.t(), padded.t())
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_bias = rows.sum(0)
        return grad_x, grad_weight, grad_bias


def onednn_usable() -> bool:
    """Whether oneDNN's product runs in this torch build and agrees with `F.linear`, forward and backward: probed
    once, so a torch release that changes or drops the op turns it off (one line said) instead of failing a run."""
    global _onednn_works
    if _onednn_works is None:
        with torch.inference_mode(False), torch.enable_grad():  # first use may be inside sampling's no-grad
            _onednn_works = ONEDNN_BUILT and _probe()
    return _onednn_works


def _probe() -> bool:
    gen = torch.Generator().manual_seed(0)
    x, weight, bias = (torch.randn(*shape, generator=gen) for shape in ((20, 32), (8, 32), (8,)))
    try:
        inputs = [t.clone().requires_grad_() for t in (x, weight, bias)]
        ours = _Linear.apply(*inputs)
        ours.square().sum().backward()
        plain = [t.clone().requires_grad_() for t in (x, weight, bias)]
        expected = torch.nn.functional.linear(*plain)
        expected.square().sum().backward()
        agrees = torch.allclose(ours, expected, rtol=1e-4, atol=1e-4) and all(
            torch.allclose(a.grad, b.grad, rtol=1e-4, atol=1e-3) for a, b in zip(inputs, plain))
        reason = "its results differ from torch.nn.functional.linear"
    except Exception as err:  # noqa: BLE001 - any failure of the op means: do not use it
        agrees, reason = False, f"{type(err).__name__}: {err}"
    if not agrees:
        print(f"fast path: oneDNN's matrix product is off ({reason}); PyTorch's own runs instead", flush=True)
    return agrees


def takes_onednn(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Does `linear` send this product to oneDNN: at least `ONEDNN_MIN_WORK` multiply-adds, float32 on the CPU,
    and the op works here? (Cheapest test first: most calls of a small model's decode step fail it.)"""
    return (x.numel() // max(x.shape[-1], 1) * weight.numel() >= ONEDNN_MIN_WORK and weight.dim() == 2
            and x.dtype == torch.float32 and weight.dtype == torch.float32 and x.device.type == "cpu"
            and onednn_usable())


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           onednn: bool = True) -> torch.Tensor:
    """`torch.nn.functional.linear(x, weight, bias)`; with `onednn`, on oneDNN where `takes_onednn` says so."""
    if not (onednn and takes_onednn(x, weight)):
        return torch.nn.functional.linear(x, weight, bias)
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad
                                    or (bias is not None and bias.requires_grad)):
        return _Linear.apply(x, weight, bias)
    return _padded_product(x, weight, bias)[0]
