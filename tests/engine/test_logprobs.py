"""Token log-probs and entropies (components/engine/logprobs.py) against values worked out by hand,
and its hand-written backward against autograd's."""

import math

import pytest
import torch

from components.engine.logprobs import token_logprobs

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
