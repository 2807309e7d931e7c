"""components/engine/generation/fast/rmsnorm.py: the hand-written backward against PyTorch's rms_norm and finite
differences."""

import pytest
import torch

from components.engine.generation.fast.rmsnorm import _RMSNorm, rms_norm


def test_gradcheck_in_float64():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, 5, 8, dtype=torch.float64, generator=gen, requires_grad=True)
    w = (torch.rand(8, dtype=torch.float64, generator=gen) + 0.5).requires_grad_()
    assert torch.autograd.gradcheck(lambda a, b: _RMSNorm.apply(a, b, 1e-6), (x, w))


@pytest.mark.parametrize("weight_trains", [True, False])
def test_values_and_gradients_match_torch_rms_norm(weight_trains):
    gen = torch.Generator().manual_seed(1)
    x0 = torch.randn(1, 40, 16, generator=gen) * 3
    w0 = torch.rand(16, generator=gen) + 0.5
    upstream = torch.randn(1, 40, 16, generator=gen)
    grads = []
    for norm in (rms_norm, lambda a, b, eps: torch.nn.functional.rms_norm(a, (16,), b, eps)):
        x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_(weight_trains)
        y = norm(x, w, 1e-5)
        (y * upstream).sum().backward()
        grads.append((y.detach(), x.grad, w.grad))
    (y_mine, gx_mine, gw_mine), (y_ref, gx_ref, gw_ref) = grads
    torch.testing.assert_close(y_mine, y_ref)
    torch.testing.assert_close(gx_mine, gx_ref)
    if weight_trains:
        torch.testing.assert_close(gw_mine, gw_ref)
    else:
        assert gw_mine is None and gw_ref is None


def test_without_a_gradient_it_is_torch_rms_norm():
    x, w = torch.randn(2, 8), torch.rand(8)
    with torch.no_grad():
        assert torch.equal(rms_norm(x, w, 1e-6), torch.nn.functional.rms_norm(x, (8,), w, 1e-6))
