"""components/engine/generation/fast/head.py: the vocabulary head's token log-probs through one buffer, by hand,
equal to the head module followed by `token_logprobs`, and without a second vocabulary-wide tensor in backward."""

import math

import pytest
import torch
from test_matmul import needs_onednn

from components.engine.generation.fast import matmul
from components.engine.generation.fast.head import LinearHead
from components.engine.generation.logprobs import head_token_logprobs, token_logprobs


def test_logprobs_and_gradients_by_hand():
    hidden = torch.tensor([[1.0, 0.0], [0.0, 2.0]], requires_grad=True)
    weight = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]], requires_grad=True)
    tokens = torch.tensor([0, 2])
    logp, entropy = LinearHead(weight).token_logprobs(hidden, tokens, with_entropy=True)
    # logits [1, 0, 1] and [0, 2, 2]
    norm = [math.log(2 * math.e + 1), math.log(1 + 2 * math.e ** 2)]
    assert torch.allclose(logp, torch.tensor([1 - norm[0], 2 - norm[1]]), atol=1e-6)
    probs = [[math.e / math.exp(norm[0]), 1 / math.exp(norm[0]), math.e / math.exp(norm[0])],
             [1 / math.exp(norm[1]), math.e ** 2 / math.exp(norm[1]), math.e ** 2 / math.exp(norm[1])]]
    expected_entropy = [-sum(p * math.log(p) for p in row) for row in probs]
    assert torch.allclose(entropy, torch.tensor(expected_entropy), atol=1e-6)
    logp.sum().backward()
    # d logp / d logits = one-hot(token) - softmax; d hidden = that . W, d W = that^T . hidden
    grad_logits = torch.tensor([[1 - probs[0][0], -probs[0][1], -probs[0][2]],
                                [-probs[1][0], -probs[1][1], 1 - probs[1][2]]])
    assert torch.allclose(hidden.grad, grad_logits @ weight.detach(), atol=1e-6)
    assert torch.allclose(weight.grad, grad_logits.t() @ hidden.detach(), atol=1e-6)


def through_the_module(hidden, weight, bias, tokens, onednn):
    """The path the head replaces: `matmul.linear` (the module's product), then `token_logprobs`."""
    return token_logprobs(matmul.linear(hidden, weight, bias, onednn=onednn), tokens, with_entropy=True)


def leaves(*tensors):
    return [t.detach().clone().requires_grad_() for t in tensors]


@pytest.mark.parametrize("onednn", [pytest.param(True, marks=needs_onednn), False])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("rows", [5, 37])  # padded to 16 and 48 rows on oneDNN
def test_equal_to_the_module_path_in_float32(monkeypatch, onednn, with_bias, rows):
    monkeypatch.setattr(matmul, "ONEDNN_MIN_WORK", 0)  # small products on oneDNN too
    gen = torch.Generator().manual_seed(rows)
    hidden, weight, bias = (torch.randn(*shape, generator=gen) for shape in ((rows, 24), (50, 24), (50,)))
    tokens = torch.randint(0, 50, (rows,), generator=gen)
    upstream = torch.randn(rows, generator=gen)  # a loss's weights on the log-probs
    results = []
    for fused in (True, False):
        h, w, b = leaves(hidden, weight, bias)
        b = b if with_bias else None
        if fused:
            logp, entropy = LinearHead(w, b, onednn).token_logprobs(h, tokens, with_entropy=True)
        else:
            logp, entropy = through_the_module(h, w, b, tokens, onednn)
        (logp * upstream).sum().backward()
        results.append([logp, entropy, h.grad, w.grad] + ([b.grad] if with_bias else []))
    for ours, theirs in zip(*results):
        assert torch.equal(ours, theirs)


@pytest.mark.parametrize("dtype,logp_dtype", [(torch.bfloat16, torch.float32), (torch.float64, torch.float64)])
def test_other_precisions_equal_to_the_module_path(dtype, logp_dtype):
    """Half precision computes its log-probs in float32, double precision keeps float64, as `token_logprobs`."""
    gen = torch.Generator().manual_seed(0)
    hidden, weight = (torch.randn(*shape, generator=gen).to(dtype) for shape in ((9, 16), (40, 16)))
    tokens = torch.randint(0, 40, (9,), generator=gen)
    results = []
    for fused in (True, False):
        h, w = leaves(hidden, weight)
        logp, _ = LinearHead(w).token_logprobs(h, tokens) if fused else token_logprobs(h @ w.t(), tokens)
        assert logp.dtype == logp_dtype
        logp.sum().backward()
        results.append([logp, h.grad, w.grad])
    for ours, theirs in zip(*results):
        assert torch.equal(ours, theirs)


def allocated_in_backward(loss: torch.Tensor) -> int:
    """Bytes allocated while `loss` is back-propagated: the largest event of PyTorch's profiler, whose events count
    the allocations of the operators they call (the head's backward node holds all of its own)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        loss.backward()
    return max((e.cpu_memory_usage for e in prof.events() if e.cpu_memory_usage > 0), default=0)


# oneDNN copies a transposed operand, so the weight's gradient there reads a copy of the logits' gradient: the case
# of a frozen head (LoRA) is the one without it. PyTorch's own product reads it in place.
@pytest.mark.parametrize("onednn,head_trains", [pytest.param(True, False, marks=needs_onednn), (False, True)])
def test_backward_allocates_no_vocabulary_wide_tensor(monkeypatch, onednn, head_trains):
    monkeypatch.setattr(matmul, "ONEDNN_MIN_WORK", 0)
    rows, vocab, width = 400, 4000, 16
    gen = torch.Generator().manual_seed(1)
    hidden, weight = (torch.randn(*shape, generator=gen) for shape in ((rows, width), (vocab, width)))
    tokens = torch.randint(0, vocab, (rows,), generator=gen)
    wide = rows * vocab * 4
    h, w = leaves(hidden, weight)
    w.requires_grad_(head_trains)
    fused = allocated_in_backward(LinearHead(w, onednn=onednn).token_logprobs(h, tokens)[0].sum())
    h, w = leaves(hidden, weight)
    w.requires_grad_(head_trains)
    plain = allocated_in_backward(through_the_module(h, w, None, tokens, onednn)[0].sum())
    assert plain >= wide  # the module path's softmax gradient (and its padded copy)
    assert fused <= (vocab + rows) * width * 4 + rows * 4  # the gradients of W and of the hidden state, a scale


def test_a_second_backward_through_the_buffer_is_refused():
    h, w = leaves(torch.randn(4, 8), torch.randn(30, 8))
    logp, _ = LinearHead(w).token_logprobs(h, torch.tensor([1, 2, 3, 4]))
    logp.sum().backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        logp.sum().backward()


def test_chunked_logprobs_take_the_heads_own_path_and_equal_the_module_path(monkeypatch):
    """`head_token_logprobs` in chunks recomputed in backward: the same values through the head as through the
    module, and the head's own function is what runs."""
    from components.engine.generation.fast import head as head_module

    calls = []
    original = head_module._HeadTokenLogProbs.apply
    monkeypatch.setattr(head_module._HeadTokenLogProbs, "apply", lambda *a: calls.append(1) or original(*a))
    gen = torch.Generator().manual_seed(2)
    hidden, weight = (torch.randn(*shape, generator=gen) for shape in ((23, 16), (60, 16)))
    tokens = torch.randint(0, 60, (23,), generator=gen)
    results = []
    for head_of in (lambda w: LinearHead(w, temperature=0.7), lambda w: (lambda x: (x / 0.7) @ w.t())):
        h, w = leaves(hidden, weight)
        logp, _ = head_token_logprobs(head_of(w), h, tokens, 60, chunk_rows=8)
        logp.sum().backward()
        results.append([logp, h.grad, w.grad])
    assert len(calls) == 6  # 3 chunks, each in forward and again in backward's recompute
    for ours, theirs in zip(*results):
        assert torch.allclose(ours, theirs, atol=1e-6)
