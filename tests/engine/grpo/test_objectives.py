"""The GRPO objective against numbers worked out by hand in the comments."""

import math

import pytest
import torch

from components.engine.grpo.objectives import GRPOLoss, group_advantages, kl_estimate, masked_mean, policy_loss
from components.losses import CispoSettings, ClipRange, Normalisers, SapoSettings, sequence_mean

# Two sequences, three completion positions; the second position of row 0 is padding after EOS.
MASK = torch.tensor([[1, 1, 0], [1, 1, 1]])
# Importance ratios rho = exp(logp - old): row 0 -> [1.3, 0.9, pad 5.0], row 1 -> [0.7, 1.1, 1.0].
RATIOS = torch.tensor([[1.3, 0.9, 5.0], [0.7, 1.1, 1.0]])
OLD = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, -1.2, -2.2]])
LOGP = OLD + torch.log(RATIOS)
ADV = torch.tensor([1.0, -2.0])


def test_group_advantages_group_std():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 1.0])
    # group 1: mean 0.5, unbiased std sqrt(4 * 0.25 / 3) = 0.57735 -> +-0.5 / (0.57735 + 1e-4)
    s1 = math.sqrt(1 / 3)
    # group 2: mean 0.25, unbiased std sqrt((3 * 0.0625 + 0.5625) / 3) = 0.5
    expected = [0.5 / (s1 + 1e-4), -0.5 / (s1 + 1e-4), -0.5 / (s1 + 1e-4), 0.5 / (s1 + 1e-4),
                -0.25 / 0.5001, -0.25 / 0.5001, -0.25 / 0.5001, 0.75 / 0.5001]
    assert group_advantages(rewards, 4, "group").tolist() == pytest.approx(expected, rel=1e-5)


def test_group_advantages_batch_and_none():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 1.0])
    centred = [0.5, -0.5, -0.5, 0.5, -0.25, -0.25, -0.25, 0.75]
    # batch std of the 8 rewards (3 ones): mean 0.375, unbiased var = (3 * 0.390625 + 5 * 0.140625) / 7
    batch_std = math.sqrt((3 * 0.625 ** 2 + 5 * 0.375 ** 2) / 7)
    assert group_advantages(rewards, 4, "batch").tolist() == pytest.approx(
        [c / (batch_std + 1e-4) for c in centred], rel=1e-5)
    assert group_advantages(rewards, 4, "none").tolist() == pytest.approx(centred)


def test_group_with_equal_rewards_has_zero_advantage():
    assert group_advantages(torch.tensor([1.0, 1.0, 0.0, 0.0]), 2, "group").tolist() == [0.0, 0.0, 0.0, 0.0]


def test_group_advantages_rejects_ragged_groups():
    with pytest.raises(ValueError, match="groups of 3"):
        group_advantages(torch.zeros(4), 3)


# Per-token surrogate -min(rho*A, clip(rho, 0.8, 1.2)*A), worked by hand:
#   row 0 (A=+1): rho 1.3 -> clipped 1.2 -> -1.2 ; rho 0.9 -> -0.9 ; padding ignored
#   row 1 (A=-2): rho 0.7 -> min(-1.4, 0.8*-2=-1.6) -> +1.6 ; rho 1.1 -> +2.2 ; rho 1.0 -> +2.0
TOKEN_EXPECTED = {
    "grpo": ((-1.2 - 0.9) / 2 + (1.6 + 2.2 + 2.0) / 3) / 2,
    "dapo": (-1.2 - 0.9 + 1.6 + 2.2 + 2.0) / 5,
    "bnpo": (-1.2 - 0.9 + 1.6 + 2.2 + 2.0) / 5,
    "dr_grpo": (-1.2 - 0.9 + 1.6 + 2.2 + 2.0) / (2 * 3),
}
# GSPO: one ratio per sequence, exp(mean log rho): row 0 sqrt(1.3*0.9), row 1 (0.7*1.1*1.0)^(1/3),
# both inside the clip range, so per-token loss is -rho*A on every real token.
S0, S1 = math.sqrt(1.3 * 0.9), (0.7 * 1.1) ** (1 / 3)
SEQ_EXPECTED = {
    "grpo": (-S0 + 2 * S1) / 2,
    "dapo": (2 * -S0 + 3 * 2 * S1) / 5,
    "bnpo": (2 * -S0 + 3 * 2 * S1) / 5,
    "dr_grpo": (2 * -S0 + 3 * 2 * S1) / 6,
}


@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "bnpo", "dr_grpo"])
def test_token_level_loss_by_hand(loss_type):
    out = policy_loss(LOGP, OLD, ADV, MASK, GRPOLoss(loss_type, ClipRange(0.2, 0.2)), counts=Normalisers(3))
    assert out.loss.item() == pytest.approx(TOKEN_EXPECTED[loss_type], rel=1e-5)
    # One of five real tokens clipped on each side: rho 1.3 with A>0 (high), rho 0.7 with A<0 (low).
    assert out.clip_high_frac.item() == pytest.approx(1 / 5)
    assert out.clip_low_frac.item() == pytest.approx(1 / 5)


@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "bnpo", "dr_grpo"])
def test_sequence_level_loss_by_hand(loss_type):
    out = policy_loss(LOGP, OLD, ADV, MASK, GRPOLoss(loss_type, ClipRange(), "sequence"), counts=Normalisers(3))
    assert out.loss.item() == pytest.approx(SEQ_EXPECTED[loss_type], rel=1e-5)


def test_clip_higher_widens_only_the_upper_side():
    # epsilon_high 0.4: rho 1.3 is no longer clipped -> row 0 token 0 contributes -1.3 instead of -1.2.
    out = policy_loss(LOGP, OLD, ADV, MASK, GRPOLoss("dapo", ClipRange(0.2, 0.4)))
    assert out.loss.item() == pytest.approx((-1.3 - 0.9 + 1.6 + 2.2 + 2.0) / 5, rel=1e-5)
    assert out.clip_high_frac.item() == 0.0


def test_ratio_is_one_when_old_equals_current():
    out = policy_loss(LOGP, LOGP.detach(), ADV, MASK, GRPOLoss("dapo", ClipRange()))
    # rho = 1: loss = -(A) averaged over tokens = (-1*2 + 2*3) / 5
    assert out.ratio_mean.item() == pytest.approx(1.0)
    assert out.loss.item() == pytest.approx((-2 + 6) / 5)


def test_padding_never_changes_the_loss():
    garbage = LOGP.clone()
    garbage[0, 2] = 123.0  # a padded position
    for loss_type in ("grpo", "dapo", "dr_grpo"):
        a = policy_loss(LOGP, OLD, ADV, MASK, GRPOLoss(loss_type, ClipRange())).loss
        b = policy_loss(garbage, OLD, ADV, MASK, GRPOLoss(loss_type, ClipRange())).loss
        assert a.item() == pytest.approx(b.item())


def test_kl_term_added_with_beta():
    ref = OLD - 0.1  # log r = ref - logp
    beta = 0.5
    out = policy_loss(LOGP, OLD, ADV, MASK, GRPOLoss("dapo", ClipRange(), beta=beta, kl_estimator="k3"), ref)
    log_r = (ref - LOGP)[MASK.bool()]
    k3 = (torch.exp(log_r) - 1 - log_r).sum().item() / 5
    assert out.kl.item() == pytest.approx(k3, rel=1e-5)
    assert out.loss.item() == pytest.approx(TOKEN_EXPECTED["dapo"] + beta * k3, rel=1e-5)


def test_kl_estimators_match_their_formulas():
    logp = torch.tensor([-1.0, -0.5, -2.0])
    ref = torch.tensor([-1.5, -0.5, -1.0])
    # log r = ref - logp = [-0.5, 0, 1]
    assert kl_estimate(logp, ref, "k1").tolist() == pytest.approx([0.5, 0.0, -1.0])
    assert kl_estimate(logp, ref, "k2").tolist() == pytest.approx([0.125, 0.0, 0.5])
    assert kl_estimate(logp, ref, "k3").tolist() == pytest.approx(
        [math.exp(-0.5) - 1 + 0.5, 0.0, math.e - 1 - 1])


def test_k3_is_never_negative():
    g = torch.Generator().manual_seed(0)
    logp, ref = torch.randn(10000, generator=g) * 3, torch.randn(10000, generator=g) * 3
    assert (kl_estimate(logp, ref, "k3") >= 0).all()


@pytest.mark.parametrize("estimator,tolerance", [("k1", 0.004), ("k2", 0.006), ("k3", 0.004)])
def test_estimators_approximate_exact_categorical_kl(estimator, tolerance):
    p = torch.tensor([0.5, 0.3, 0.2])
    q = torch.tensor([0.4, 0.4, 0.2])
    exact = float((p * (p / q).log()).sum())  # 0.5 ln 1.25 + 0.3 ln 0.75 = 0.02527
    samples = torch.multinomial(p, 400_000, replacement=True, generator=torch.Generator().manual_seed(1))
    estimate = kl_estimate(p.log()[samples], q.log()[samples], estimator).mean().item()
    assert abs(estimate - exact) < tolerance, (estimate, exact)


def test_autograd_gradient_matches_analytic():
    # dapo, token level, one clipped token: d loss / d logp_t = -A_t * rho_t / N inside the clip range,
    # 0 where the clipped branch is the minimum; plus beta * (1 - exp(ref - logp)) / N from k3.
    logp = LOGP.clone().requires_grad_(True)
    ref = OLD - 0.2
    beta = 0.1
    policy_loss(logp, OLD, ADV, MASK, GRPOLoss("dapo", ClipRange(), beta=beta), ref).loss.backward()
    n = 5.0
    expected = torch.zeros_like(LOGP)
    for i in range(2):
        for t in range(3):
            if not MASK[i, t]:
                continue
            rho, a = RATIOS[i, t].item(), ADV[i].item()
            clipped = (a > 0 and rho > 1.2) or (a < 0 and rho < 0.8)
            pg = 0.0 if clipped else -a * rho / n
            kl = beta * (1 - math.exp(ref[i, t].item() - LOGP[i, t].item())) / n
            expected[i, t] = pg + kl
    assert torch.allclose(logp.grad, expected, atol=1e-6)


def test_minibatch_normalisers_reassemble_the_full_batch_loss():
    dapo = GRPOLoss("dapo", ClipRange())
    full = policy_loss(LOGP, OLD, ADV, MASK, dapo).loss
    parts = [policy_loss(LOGP[i:i + 1], OLD[i:i + 1], ADV[i:i + 1], MASK[i:i + 1], dapo,
                         counts=Normalisers(3, num_tokens=5.0)).loss for i in range(2)]
    assert (parts[0] + parts[1]).item() == pytest.approx(full.item())
    seq = sequence_mean(torch.ones(2, 3), MASK.float(), Normalisers(3, num_sequences=4.0))
    assert seq.item() == pytest.approx(0.5)


def test_masked_mean_counts_real_positions_only():
    values = torch.tensor([[1.0, 2.0, 9.0], [3.0, 4.0, 5.0]])  # 9.0 sits in row 0's padding
    assert masked_mean(values, MASK).item() == pytest.approx((1 + 2 + 3 + 4 + 5) / 5)


def test_cispo_counts_a_capped_weight_only_where_the_advantage_is_positive():
    """TRL's cispo_clip_ratio, by hand: ratios 6, 2 (advantage +1) and 7, 0.5 (advantage -1) under a cap of 5: one
    token of four is capped (the 7 has a negative advantage: its weight is capped, but TRL does not count it)."""
    old = torch.zeros(2, 2)
    logp = torch.tensor([[6.0, 2.0], [7.0, 0.5]]).log()
    out = policy_loss(logp, old, torch.tensor([1.0, -1.0]), torch.ones(2, 2), GRPOLoss("cispo", CispoSettings(5.0)))
    assert out.clip_high_frac.item() == pytest.approx(0.25) and out.clip_low_frac.item() == 0.0
    sapo = policy_loss(logp, old, torch.tensor([1.0, -1.0]), torch.ones(2, 2), GRPOLoss("sapo", SapoSettings()))
    assert sapo.clip_high_frac.item() == 0.0 and sapo.clip_low_frac.item() == 0.0  # a soft gate clips nothing
