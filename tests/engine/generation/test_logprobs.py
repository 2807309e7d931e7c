"""Token log-probs and entropies (components/engine/generation/logprobs.py) against values worked out by hand,
and its hand-written backward against autograd's."""

import math

import pytest
import torch

from components.engine.generation.logprobs import token_logprobs

# softmax([0, ln 2, ln 3]) = [1/6, 2/6, 3/6]
LOGITS = torch.tensor([[0.0, math.log(2.0), math.log(3.0)]])


def test_logprob_and_entropy_by_hand():
    logp, entropy = token_logprobs(LOGITS, torch.tensor([2]), with_entropy=True)
    assert logp.item() == pytest.approx(math.log(0.5), rel=1e-6)
    by_hand = -(1 / 6 * math.log(1 / 6) + 2 / 6 * math.log(2 / 6) + 3 / 6 * math.log(3 / 6))  # 1.0114 nats
    assert entropy.item() == pytest.approx(by_hand, rel=1e-6)
    assert token_logprobs(LOGITS, torch.tensor([2]))[1] is None


def test_gradient_by_hand_is_onehot_minus_softmax():
    logits = LOGITS.clone().requires_grad_(True)
    logp, _ = token_logprobs(logits, torch.tensor([2]))
    (3.0 * logp).sum().backward()
    # d logp_k / d logit_j = [j == k] - p_j, scaled by the upstream 3
    assert logits.grad.tolist()[0] == pytest.approx([3 * -1 / 6, 3 * -2 / 6, 3 * (1 - 3 / 6)], rel=1e-6)


def test_entropy_of_uniform_is_log_vocab_and_shapes_follow_the_tokens():
    logp, entropy = token_logprobs(torch.zeros(2, 3, 8), torch.zeros(2, 3, dtype=torch.long), with_entropy=True)
    assert logp.shape == entropy.shape == (2, 3)
    assert torch.allclose(entropy, torch.full((2, 3), math.log(8)))
    assert torch.allclose(logp, torch.full((2, 3), -math.log(8)))


def test_backward_matches_autograd_of_log_softmax_and_gradcheck():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 4, 11, generator=gen, dtype=torch.float64, requires_grad=True)
    tokens = torch.randint(0, 11, (5, 4), generator=gen)
    upstream = torch.randn(5, 4, generator=gen, dtype=torch.float64)
    ours, _ = token_logprobs(logits, tokens)
    reference = torch.log_softmax(logits, -1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    assert torch.allclose(ours, reference)
    (grad_ours,) = torch.autograd.grad((ours * upstream).sum(), logits)
    (grad_ref,) = torch.autograd.grad((reference * upstream).sum(), logits)
    assert torch.allclose(grad_ours, grad_ref)
    assert torch.autograd.gradcheck(lambda x: token_logprobs(x, tokens)[0], (logits,))


def test_half_precision_logits_are_scored_in_float32():
    logp, _ = token_logprobs(LOGITS.to(torch.bfloat16), torch.tensor([2]))
    assert logp.dtype == torch.float32


def test_logit_chunk_rows_by_hand(monkeypatch):
    from components.engine.generation import logprobs

    # SmolLM2's 49,152-token vocabulary: 1,365 rows fit the 256 MiB budget at once, chunks hold 341 rows.
    assert logprobs.logit_chunk_rows(1365, 49152) == 1365
    assert logprobs.logit_chunk_rows(1366, 49152) == 341
    monkeypatch.setattr(logprobs, "LOGITS_BUDGET_BYTES", 4 * 11 * 9)
    monkeypatch.setattr(logprobs, "LOGITS_CHUNK_BYTES", 4 * 11 * 3)
    assert logprobs.logit_chunk_rows(9, 11) == 9 and logprobs.logit_chunk_rows(10, 11) == 3


@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
def test_head_logprobs_in_chunks_equal_one_pass_in_values_and_gradients(bias):
    """Chunked head (recomputed in backward) against the whole [rows, vocab] logits: log-probs, entropies and the
    gradients of hidden states, weight and bias."""
    from components.engine.generation.logprobs import head_token_logprobs

    gen = torch.Generator().manual_seed(3)
    head = torch.nn.Linear(6, 11, bias=bias, dtype=torch.float64)
    hidden = torch.randn(10, 6, generator=gen, dtype=torch.float64, requires_grad=True)
    tokens = torch.randint(0, 11, (10,), generator=gen)
    upstream = torch.randn(10, generator=gen, dtype=torch.float64)

    def run(chunk_rows):
        head.zero_grad()
        hidden.grad = None
        logp, entropy = head_token_logprobs(lambda h: head(h) / 0.7, hidden, tokens, 11, True, chunk_rows)
        (logp * upstream).sum().backward()
        grads = [hidden.grad.clone(), head.weight.grad.clone()] + ([head.bias.grad.clone()] if bias else [])
        return logp.detach(), entropy, grads

    whole, chunked = run(None), run(3)  # 10 rows: chunks of 3, 3, 3, 1
    reference = torch.log_softmax(head(hidden) / 0.7, -1).gather(-1, tokens[:, None]).squeeze(-1)
    assert torch.allclose(whole[0], reference) and torch.allclose(chunked[0], reference)
    assert torch.allclose(chunked[1], whole[1])
    for a, b in zip(chunked[2], whole[2]):
        assert torch.allclose(a, b, atol=1e-12)
    with torch.no_grad():  # no gradient: plain chunks, same values
        assert torch.allclose(head_token_logprobs(head, hidden, tokens, 11, chunk_rows=4)[0],
                              torch.log_softmax(head(hidden), -1).gather(-1, tokens[:, None]).squeeze(-1))


def test_chunked_backward_never_holds_logits_for_all_rows():
    """The memory claim itself: autograd keeps no tensor of [rows, vocab] between forward and backward."""
    from components.engine.generation.logprobs import head_token_logprobs

    head = torch.nn.Linear(8, 500, bias=False)
    hidden = torch.randn(64, 8, requires_grad=True)
    tokens = torch.randint(0, 500, (64,))
    sizes = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        sizes.append(t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        logp, _ = head_token_logprobs(head, hidden, tokens, 500, chunk_rows=16)
    assert sum(sizes) < 64 * 500 / 4, "logits or log-softmax of the chunks were kept for backward"
    sizes.clear()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        head_token_logprobs(head, hidden, tokens, 500, chunk_rows=64)
    assert sum(sizes) >= 64 * 500, "one pass keeps the log-softmax (the test would not notice a regression)"
    logp.sum().backward()
    assert hidden.grad is not None and head.weight.grad is not None
