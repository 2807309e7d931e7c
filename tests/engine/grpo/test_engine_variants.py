"""Every GRPO variant against a naive per-element reference, plus reference policies, LoRA,
DAPO dynamic sampling, minibatch accumulation and the reinforce baseline."""

import itertools
import math

import pytest
import torch

from components.config import ConfigError, GRPOConfig, LoRAConfig, load_config
from components.engine.generation.engines.base import SamplingParams
from components.engine.generation.engines.hf import HFEngine
from components.engine.generation.logprobs import completion_logprobs
from components.engine.grpo.batch import informative_groups
from components.engine.grpo.objectives import GRPOLoss, group_advantages, policy_loss
from components.engine.grpo.policy import Policy, attach_lora, update_reference
from components.engine.grpo.update import policy_updates
from components.losses import ClipRange, Normalisers
from tests.engine.grpo.trajectories import trajectory
from tests.engine.sampling import sample_texts

from conftest import committed_params

# Two groups of two completions, three positions; row 2 has one padded position. mu > 1, so the
# current policy has moved away from the rollout policy: ratios on both sides of the clip range.
REWARDS = [1.0, 0.0, 0.5, 0.0]
MASK = [[1, 1, 1], [1, 1, 0], [1, 1, 1], [1, 0, 0]]
RATIOS = [[1.5, 0.9, 1.1], [0.6, 1.05, 3.0], [0.7, 1.3, 1.0], [1.25, 2.0, 2.0]]
OLD = [[-0.5, -1.0, -2.0], [-1.5, -0.3, -0.7], [-0.2, -0.9, -1.1], [-2.0, -0.4, -0.6]]
EPS_LOW, EPS_HIGH = 0.2, 0.28


def naive_advantages(scale):
    groups = [REWARDS[0:2], REWARDS[2:4]]
    out = []
    batch_mean = sum(REWARDS) / 4
    batch_std = math.sqrt(sum((r - batch_mean) ** 2 for r in REWARDS) / 3)
    for g in groups:
        mean = sum(g) / 2
        std = math.sqrt(sum((r - mean) ** 2 for r in g) / 1)
        for r in g:
            denom = {"group": std + 1e-4, "batch": batch_std + 1e-4, "none": 1.0}[scale]
            out.append((r - mean) / denom)
    return out


def naive_loss(loss_type, scale, level):
    adv = naive_advantages(scale)
    per_token = []
    for i in range(4):
        real = [t for t in range(3) if MASK[i][t]]
        if level == "sequence":
            seq_ratio = math.exp(sum(math.log(RATIOS[i][t]) for t in real) / len(real))
            ratios = {t: seq_ratio for t in real}
        else:
            ratios = {t: RATIOS[i][t] for t in real}
        row = []
        for t in real:
            rho = ratios[t]
            clipped = min(max(rho, 1 - EPS_LOW), 1 + EPS_HIGH)
            row.append(-min(rho * adv[i], clipped * adv[i]))
        per_token.append(row)
    if loss_type == "grpo":
        return sum(sum(r) / len(r) for r in per_token) / 4
    if loss_type in ("dapo", "bnpo"):
        return sum(sum(r) for r in per_token) / sum(len(r) for r in per_token)
    return sum(sum(r) for r in per_token) / (4 * 3)  # dr_grpo


@pytest.mark.parametrize("loss_type,scale,level", list(itertools.product(
    ["grpo", "dapo", "bnpo", "dr_grpo"], ["group", "batch", "none"], ["token", "sequence"])))
def test_every_variant_matches_the_naive_reference(loss_type, scale, level):
    old = torch.tensor(OLD)
    logp = old + torch.log(torch.tensor(RATIOS))
    adv = group_advantages(torch.tensor(REWARDS), 2, scale)
    out = policy_loss(logp, old, adv, torch.tensor(MASK), GRPOLoss(loss_type, ClipRange(EPS_LOW, EPS_HIGH), level),
                      counts=Normalisers(3))
    assert out.loss.item() == pytest.approx(naive_loss(loss_type, scale, level), rel=1e-5, abs=1e-7)


def test_token_level_case_clips_on_both_sides():
    old = torch.tensor(OLD)
    logp = old + torch.log(torch.tensor(RATIOS))
    adv = group_advantages(torch.tensor(REWARDS), 2, "none")  # [0.5, -0.5, 0.25, -0.25]
    out = policy_loss(logp, old, adv, torch.tensor(MASK), GRPOLoss("dapo", ClipRange(EPS_LOW, EPS_HIGH)))
    # high: row 0 rho 1.5 (A>0), row 2 rho 1.3 (A>0, 1.3 > 1.28); low: row 1 rho 0.6 (A<0). 9 real tokens.
    assert out.clip_high_frac.item() == pytest.approx(2 / 9)
    assert out.clip_low_frac.item() == pytest.approx(1 / 9)


class Lin(torch.nn.Module):
    def __init__(self, w):
        super().__init__()
        self.w = torch.nn.Parameter(torch.tensor(w))


def test_ema_reference_moves_by_alpha():
    ref, pol = Lin([0.0, 4.0]), Lin([2.0, 0.0])
    update_reference(ref, pol, "ema", step=0, ema_alpha=0.25, sync_every=1)
    assert ref.w.tolist() == [0.5, 3.0]  # 0.75 * ref + 0.25 * policy
    update_reference(ref, pol, "ema", step=1, ema_alpha=0.25, sync_every=1)
    assert ref.w.tolist() == pytest.approx([0.875, 2.25])


def test_periodic_reference_copies_only_every_sync_every_steps():
    ref, pol = Lin([0.0]), Lin([1.0])
    copied = [update_reference(ref, pol, "periodic", step=s, ema_alpha=0.1, sync_every=3) for s in range(3)]
    assert copied == [False, False, True] and ref.w.tolist() == [1.0]
    pol.w.data.fill_(5.0)
    update_reference(ref, pol, "periodic", step=3, ema_alpha=0.1, sync_every=3)
    assert ref.w.tolist() == [1.0]


def test_static_reference_never_changes():
    ref, pol = Lin([0.0]), Lin([1.0])
    for s in range(10):
        assert update_reference(ref, pol, "static", step=s, ema_alpha=0.5, sync_every=1) is False
    assert ref.w.tolist() == [0.0]


def test_informative_groups():
    assert informative_groups([1, 1, 0, 1, 0, 0, 0.5, 0.2], 2) == [1, 3]


def test_reinforce_config_rules():
    with pytest.raises(ConfigError, match="grpo.group_size: must be 1 with grpo.algorithm: reinforce"):
        load_config(committed_params(), ["grpo.algorithm=reinforce"])
    with pytest.raises(ConfigError, match="grpo.kl_beta: must be 0"):
        load_config(committed_params(), ["grpo.algorithm=reinforce", "grpo.group_size=1"])
    with pytest.raises(ConfigError, match="grpo.minibatch_size: must be a multiple of grpo.group_size"):
        load_config(committed_params(), ["grpo.minibatch_size=12"])


@pytest.fixture(scope="module")
def tiny_model():
    from components.config import TinyModelConfig
    from components.engine.models.modeling import build_char_tokenizer, build_tiny_model

    tok = build_char_tokenizer(["0123456789+="])
    return tok, build_tiny_model(TinyModelConfig(), tok, seed=0)


def _rollout(tok, model, n_prompts=4, group=4):
    return sample_texts(model, tok, [f"{i}+{i + 3}=" for i in range(n_prompts)],
                        SamplingParams(n=group, max_new_tokens=4), torch.Generator().manual_seed(0))


@pytest.mark.parametrize("checkpointing", [False, True], ids=["", "checkpointed-micro-batches"])
@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "dr_grpo"])
def test_minibatch_accumulation_equals_full_batch_update(tiny_model, loss_type, checkpointing):
    """Micro-batches of 4 rows (each layer recomputed in backward, when checkpointed) give one pass's update."""
    import copy

    tok, base = tiny_model
    rollout = _rollout(tok, base)
    adv = torch.linspace(-1, 2, len(rollout))
    results = []
    for minibatch in (0, 4):
        model = copy.deepcopy(base).train()
        g = GRPOConfig(group_size=4, prompts_per_step=4, minibatch_size=minibatch, kl_beta=0.0, loss_type=loss_type,
                       max_grad_norm=1e9)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        from components.engine.generation.engines.base import SpecialTokens

        policy = Policy.of(tok, model, HFEngine(model, SpecialTokens.of(tok),
                                                gradient_checkpointing=checkpointing and minibatch > 0))
        stats = policy_updates(policy, opt, trajectory(rollout, adv), g)
        results.append((stats.loss, [p.detach().clone() for p in model.parameters()]))
    assert abs(results[0][0]) > 1e-3 and results[0][0] == pytest.approx(results[1][0], rel=1e-5)
    assert any(not torch.equal(a, b) for a, b in zip(results[0][1], base.parameters())), "no update happened"
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(results[0][1], results[1][1]))


def test_mu_2_first_pass_has_ratio_one_then_moves(tiny_model):
    import copy

    tok, base = tiny_model
    rollout = _rollout(tok, base)
    model = copy.deepcopy(base).train()
    g = GRPOConfig(group_size=4, prompts_per_step=4, num_iterations=2, kl_beta=0.0, epsilon=0.01)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    adv = torch.linspace(-1, 1, len(rollout))
    policy = Policy.of(tok, model)
    stats = policy_updates(policy, opt, trajectory(rollout, adv, policy=policy, g=g), g)
    # Pass 1: ratio 1, nothing clipped. Pass 2, after a big SGD step: ratios leave [0.99, 1.01] -> clipping.
    assert stats.updates == 2
    assert stats.clip_low_frac + stats.clip_high_frac > 0


def test_lora_refuses_missing_modules_and_trains_only_adapters(tiny_model):
    import copy

    tok, base = tiny_model
    with pytest.raises(ConfigError, match=r"grpo.lora.target_modules: \['c_attn'\] not found"):
        attach_lora(copy.deepcopy(base), LoRAConfig(enabled=True, target_modules=["c_attn"]))
    model = attach_lora(copy.deepcopy(base), LoRAConfig(enabled=True, rank=4, target_modules=["q_proj", "v_proj"]))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    rollout = _rollout(tok, model)
    g = GRPOConfig(group_size=4, prompts_per_step=4, kl_beta=0.1)
    policy = Policy.of(tok, model.train(), lora=True)
    ref = policy.reference_logprobs(rollout)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    for _ in range(3):
        policy_updates(policy, opt, trajectory(rollout, torch.linspace(-1, 1, len(rollout)), ref_logp=ref), g)
    changed = {n for n, p in model.named_parameters() if not torch.equal(p, before[n])}
    assert changed and all("lora_" in n for n in changed)
    # The reference (adapters disabled) is still the untouched base model.
    assert torch.allclose(policy.reference_logprobs(rollout), completion_logprobs(base, rollout)[0], atol=1e-6)
