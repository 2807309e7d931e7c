"""components/engine/generation/fast/matmul.py: oneDNN products and their backward, by hand and against F.linear, and
the prompt-once forward running on them."""

import pytest
import torch

from components.engine.generation.fast import matmul
from components.engine.generation.fast.matmul import linear, padded_rows, takes_onednn

needs_onednn = pytest.mark.skipif(not matmul.ONEDNN_BUILT, reason="this PyTorch build has no oneDNN")


@pytest.fixture
def every_product_on_onednn(monkeypatch):
    """Send every float32 CPU product to oneDNN and count the calls."""
    calls = []
    matmul.onednn_usable()  # the probe's own products are not counted
    product = matmul.onednn_product

    def counted(*args):
        calls.append(args[0].shape)
        return product(*args)

    monkeypatch.setattr(matmul, "ONEDNN_MIN_WORK", 0)
    monkeypatch.setattr(matmul, "onednn_product", counted)
    return calls


def test_padded_rows_by_hand():
    assert [padded_rows(r) for r in (1, 16, 17, 97, 128, 129, 255, 256, 257, 418, 512, 513, 1100)] == \
        [16, 16, 32, 112, 128, 144, 256, 256, 272, 432, 512, 544, 1152]


@needs_onednn
def test_only_float32_cpu_products_of_enough_work_take_onednn():
    weight = torch.zeros(128, 64)
    rows = matmul.ONEDNN_MIN_WORK // (128 * 64)
    assert takes_onednn(torch.zeros(rows, 64), weight)
    assert takes_onednn(torch.zeros(1, rows, 64), weight)
    assert not takes_onednn(torch.zeros(rows - 1, 64), weight)
    assert not takes_onednn(torch.zeros(rows, 64, dtype=torch.float64), weight.double())


@needs_onednn
def test_values_and_gradients_by_hand(every_product_on_onednn):
    x = torch.tensor([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]], requires_grad=True)
    weight = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]], requires_grad=True)
    bias = torch.tensor([0.5, -1.0, 2.0], requires_grad=True)
    y = linear(x, weight, bias)
    assert type(y.grad_fn).__name__ == "_LinearBackward"
    assert torch.equal(y, torch.tensor([[1.5, 1.0, 5.0], [3.5, 3.0, 9.0], [5.5, 5.0, 13.0]]))
    y.sum().backward()
    assert torch.equal(x.grad, torch.full((3, 2), 2.0))  # each row: sum of W's rows
    assert torch.equal(weight.grad, torch.tensor([[9.0, 12.0]] * 3))  # each output: sum of x's rows
    assert torch.equal(bias.grad, torch.full((3,), 3.0))
    assert len(every_product_on_onednn) == 3  # forward, dx, dW


@needs_onednn
@pytest.mark.parametrize("shape", [(3, 37, 64), (256, 64), (1, 5, 64)])
def test_padded_products_match_f_linear_with_and_without_a_gradient(every_product_on_onednn, shape):
    gen = torch.Generator().manual_seed(0)
    x0, w0, b0 = torch.randn(shape, generator=gen), torch.randn(48, 64, generator=gen), torch.randn(48, generator=gen)
    upstream = torch.randn(*shape[:-1], 48, generator=gen)
    results = []
    for product in (linear, torch.nn.functional.linear):
        x, w, b = (t.clone().requires_grad_() for t in (x0, w0, b0))
        y = product(x, w, b)
        (y * upstream).sum().backward()
        results.append((y.detach(), x.grad, w.grad, b.grad))
    for mine, reference in zip(*results):
        torch.testing.assert_close(mine, reference, rtol=1e-5, atol=1e-5)
    with torch.inference_mode():
        torch.testing.assert_close(linear(x0, w0, b0), torch.nn.functional.linear(x0, w0, b0), rtol=1e-5, atol=1e-5)
    assert every_product_on_onednn and all(rows[0] % 16 == 0 for rows in every_product_on_onednn)


@needs_onednn
@pytest.mark.parametrize("arch", ["llama-gqa-tied", "qwen2-bias-gqa", "qwen3-qk-norm"])
def test_the_prompt_once_forward_on_onednn_matches_hugging_face(every_product_on_onednn, arch):
    from components.engine.generation.fast.build import checked_prefix_shared_lm
    from components.engine.generation.logprobs import completion_logprobs
    from tests.engine.generation.fast.test_fastlm import (
        ARCHITECTURES,
        _assert_same_logprobs_and_grads,
        _logprobs_and_grads,
        _rollout,
    )

    model = ARCHITECTURES[arch]()
    fast = checked_prefix_shared_lm(model)
    assert fast is not None and fast.options.onednn_matmul
    rollout = _rollout()
    ref_logp, ref_grads = _logprobs_and_grads(model, rollout, lambda r, t: completion_logprobs(model, r, t))
    every_product_on_onednn.clear()
    fast_logp, fast_grads = _logprobs_and_grads(model, rollout, fast.completion_logprobs)
    assert len(every_product_on_onednn) >= 3 * 2 * len(model.model.layers)  # q|k|v, o, MLP: forward and backward
    _assert_same_logprobs_and_grads(rollout, (fast_logp, fast_grads), (ref_logp, ref_grads))


@needs_onednn
def test_switched_off_it_never_calls_onednn(every_product_on_onednn):
    from components.engine.generation.fast.build import checked_prefix_shared_lm
    from components.engine.generation.fast.pieces import FastOptions
    from tests.engine.generation.fast.test_fastlm import ARCHITECTURES, _logprobs_and_grads, _rollout

    model = ARCHITECTURES["llama"]()
    fast = checked_prefix_shared_lm(model, options=FastOptions(onednn_matmul=False))
    assert fast is not None and not fast.over(ARCHITECTURES["llama"]()).options.onednn_matmul
    _logprobs_and_grads(model, _rollout(), fast.completion_logprobs)
    assert every_product_on_onednn == []


@pytest.mark.parametrize("failure", ["raises", "disagrees"])
def test_a_failing_or_disagreeing_onednn_op_is_probed_once_and_turned_off(monkeypatch, capsys, failure):
    """A torch release that changes the op: `linear` falls back to PyTorch's own product, with one line said."""
    calls = []

    def broken(x, weight, bias=None):
        calls.append(1)
        if failure == "raises":
            raise RuntimeError("mkldnn::_linear_pointwise: no such overload")
        return torch.zeros(x.shape[0], weight.shape[0])

    monkeypatch.setattr(matmul, "onednn_product", broken)
    monkeypatch.setattr(matmul, "_onednn_works", None)
    monkeypatch.setattr(matmul, "ONEDNN_BUILT", True)
    x, weight = torch.randn(512, 256), torch.randn(256, 256)  # 33M multiply-adds: above ONEDNN_MIN_WORK
    assert torch.allclose(matmul.linear(x, weight), torch.nn.functional.linear(x, weight), atol=1e-4)
    probed = len(calls)
    assert probed >= 1
    for _ in range(2):
        assert torch.allclose(matmul.linear(x, weight), torch.nn.functional.linear(x, weight), atol=1e-4)
    assert len(calls) == probed  # probed once, then never called again
    assert capsys.readouterr().out.count("oneDNN's matrix product is off") == 1


@needs_onednn
@pytest.mark.parametrize("context", ["inference_mode", "no_grad"])
def test_the_probe_passes_where_it_first_runs_inside_sampling(monkeypatch, capsys, context):
    """Sampling (inference mode, no gradient) is usually the first user of a product: the probe's own forward and
    backward must still run there, or a working oneDNN would be turned off."""
    monkeypatch.setattr(matmul, "_onednn_works", None)
    with torch.inference_mode() if context == "inference_mode" else torch.no_grad():
        assert matmul.onednn_usable()
    assert "is off" not in capsys.readouterr().out
