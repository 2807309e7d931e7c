"""Rollout correction: its weights by hand and against TRL 1.16's lines, then inside a real update (the gradient is
the loss weighted token by token), its metrics, and its rules."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from components.config import ConfigError, GRPOConfig, load_config
from components.engine.generation.engines.base import SamplingParams, SpecialTokens
from components.engine.generation.engines.hf import HFEngine
from components.engine.generation.logprobs import completion_logprobs
from components.engine.generation.rollouts import encode_prompts
from components.engine.grpo.objectives import build_loss
from components.engine.grpo.policy import Policy
from components.engine.grpo.rollout_correction import CorrectionStats, RolloutCorrection
from components.engine.grpo.update import policy_updates
from tests.engine.grpo.trajectories import trajectory

from conftest import committed_params

TRAINER = torch.tensor([[-1.0, -2.0, -0.5], [-0.1, -0.2, -0.3]])
SAMPLER = torch.tensor([[-1.5, -1.0, math.nan], [-0.1, -0.2, -0.3]])
WRITTEN = torch.tensor([[1, 1, 0], [1, 1, 1]])
E = math.e


@pytest.mark.parametrize("mode,low,high,expected", [
    # row 0: differences +0.5, -1.0 and an unwritten token (ratio 1); row 1: no difference
    ("token_truncate", 0.5, 1.5, [[1.5, 0.5, 1.0], [1.0, 1.0, 1.0]]),
    ("token_truncate", None, 3.0, [[E ** 0.5, E ** -1, 1.0], [1.0, 1.0, 1.0]]),
    ("token_mask", 0.5, 1.5, [[0.0, 0.0, 1.0], [1.0, 1.0, 1.0]]),
    ("token_mask", 0.3, None, [[E ** 0.5, E ** -1, 1.0], [1.0, 1.0, 1.0]]),
    # one ratio per row: exp(0.5 - 1.0)
    ("sequence_truncate", None, 3.0, [[E ** -0.5], [1.0]]),
    ("sequence_truncate", 0.7, 3.0, [[0.7], [1.0]]),
    ("sequence_mask", 0.7, 3.0, [[0.0], [1.0]]),
    ("sequence_mask", None, 3.0, [[E ** -0.5], [1.0]]),
])
def test_weights_by_hand(mode, low, high, expected):
    weights = RolloutCorrection(mode, high, low).weights(TRAINER, SAMPLER, WRITTEN)
    torch.testing.assert_close(weights, torch.tensor(expected), rtol=1e-6, atol=1e-7)


def trl_weights(old_per_token_logps, sampling_per_token_logps, mask, mode, clip_min, clip_max):
    """TRL 1.16's GRPOTrainer._generate_and_score_completions, the vllm_importance_sampling_correction lines, verbatim
    but for the names of the trainer's attributes."""
    per_token_logps_diff = (old_per_token_logps - sampling_per_token_logps) * mask
    per_token_logps_diff = torch.nan_to_num(per_token_logps_diff, nan=0.0)
    sequence_level_is = mode in ["sequence_mask", "sequence_truncate"]
    if sequence_level_is:
        per_sequence_logps_diff = per_token_logps_diff.sum(dim=-1, keepdim=True)
        logps_diff = per_sequence_logps_diff
    else:
        logps_diff = per_token_logps_diff
    vllm_importance_sampling_ratio = torch.exp(logps_diff)
    if mode in ["sequence_truncate", "token_truncate"]:
        vllm_importance_sampling_ratio = torch.clamp(vllm_importance_sampling_ratio, min=clip_min, max=clip_max)
    else:
        min_val = clip_min if clip_min is not None else -math.inf
        max_val = clip_max if clip_max is not None else math.inf
        invalid_mis_mask = (vllm_importance_sampling_ratio < min_val) | (vllm_importance_sampling_ratio > max_val)
        vllm_importance_sampling_ratio = vllm_importance_sampling_ratio.masked_fill(invalid_mis_mask, value=0.0)
    return vllm_importance_sampling_ratio


@pytest.mark.parametrize("mode", ["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"])
@pytest.mark.parametrize("low,high", [(None, 3.0), (0.5, 2.0), (0.9, None)])
def test_weights_equal_trls(mode, low, high):
    if mode.endswith("truncate") and low is not None and high is None:
        high = 5.0
    g = torch.Generator().manual_seed(0)
    trainer = -torch.rand(6, 9, generator=g) * 3
    sampler = trainer + torch.randn(6, 9, generator=g) * 0.4
    sampler[0, 2] = math.nan
    written = (torch.rand(6, 9, generator=g) > 0.2).float()
    ours = RolloutCorrection(mode, high, low).weights(trainer, sampler, written)
    torch.testing.assert_close(ours, trl_weights(trainer, sampler, written, mode, low, high), rtol=0, atol=0)


def test_metrics_count_the_models_tokens_or_the_rows():
    stats = CorrectionStats()
    RolloutCorrection("token_mask", 1.5, 0.5).weights(TRAINER, SAMPLER, WRITTEN, stats)
    metrics = stats.metrics()  # five written tokens: weights 0, 0, 1, 1, 1; two outside
    assert metrics["rollout_correction/ratio_mean"] == pytest.approx(3 / 5)
    assert metrics["rollout_correction/ratio_min"] == 0.0 and metrics["rollout_correction/ratio_max"] == 1.0
    assert metrics["rollout_correction/outside_frac"] == pytest.approx(2 / 5)
    rows = CorrectionStats()
    RolloutCorrection("sequence_truncate", 3.0, 0.7).weights(TRAINER, SAMPLER, WRITTEN, rows)
    assert rows.count == 2 and rows.metrics()["rollout_correction/outside_frac"] == pytest.approx(1 / 2)
    assert CorrectionStats().metrics() == {}


@pytest.fixture(scope="module")
def tiny_model():
    from components.config import TinyModelConfig
    from components.engine.models.modeling import build_char_tokenizer, build_tiny_model

    tok = build_char_tokenizer(["0123456789+="])
    return tok, build_tiny_model(TinyModelConfig(), tok, seed=0)


@pytest.mark.parametrize("mode", ["token_truncate", "sequence_mask"])
def test_the_update_weights_each_tokens_policy_gradient(tiny_model, mode):
    """A sampler at another temperature than the trainer's (a gap far above rounding): the update's gradient is that
    of the loss whose policy-gradient term is weighted by the correction computed by hand here (SGD, lr 1)."""
    tok, base = tiny_model
    rollout = HFEngine(base.eval(), SpecialTokens.of(tok)).sample(
        encode_prompts(tok, [f"{i}+{i + 3}=" for i in range(4)]),
        SamplingParams(n=4, max_new_tokens=5, temperature=0.8), torch.Generator().manual_seed(0))
    adv = torch.linspace(-1, 2, 16)
    g = GRPOConfig(group_size=4, prompts_per_step=4, kl_beta=0.0, max_grad_norm=1e9, rollout_correction=mode,
                   rollout_correction_max=1.2, rollout_correction_min=0.8)
    reference = copy.deepcopy(base).train()
    logp, _ = completion_logprobs(reference, rollout, 1.0)
    expected_weights = RolloutCorrection(mode, 1.2, 0.8).weights(logp.detach(), rollout.sampling_logp,
                                                                rollout.written)
    assert not torch.equal(expected_weights, torch.ones_like(expected_weights))
    g_off = GRPOConfig(group_size=4, prompts_per_step=4, kl_beta=0.0, max_grad_norm=1e9)
    build_loss(g_off)(logp, logp.detach(), adv, rollout.completion_mask, num_sequences=16.0,
                      token_mask=expected_weights).loss.backward()
    model = copy.deepcopy(base).train()
    before = [p.detach().clone() for p in model.parameters()]
    stats = policy_updates(Policy.of(tok, model), torch.optim.SGD(model.parameters(), lr=1.0),
                           trajectory(rollout, adv), g)
    for old, new, p in zip(before, model.parameters(), reference.parameters()):
        torch.testing.assert_close(old - new, p.grad, rtol=1e-4, atol=1e-6)
    assert stats.correction.count == (rollout.written.sum() if mode.startswith("token") else 16)
    assert 0 < stats.correction.outside < stats.correction.count


def test_off_by_default_and_rules():
    assert GRPOConfig().rollout_correction == "none" and not build_loss(GRPOConfig()).rollout_correction.enabled
    params = committed_params()
    assert load_config(params, ["grpo.rollout_correction=token_mask"]).grpo.rollout_correction == "token_mask"
    for overrides, key in ((["grpo.rollout_correction_max=0"], "grpo.rollout_correction_max"),
                           (["grpo.rollout_correction_min=-1"], "grpo.rollout_correction_min"),
                           (["grpo.rollout_correction_min=3", "grpo.rollout_correction_max=2"],
                            "grpo.rollout_correction_min"),
                           (["grpo.rollout_correction=token_truncate", "grpo.rollout_correction_max=null"],
                            "grpo.rollout_correction_max"),
                           (["grpo.rollout_correction=sometimes"], "grpo.rollout_correction")):
        with pytest.raises(ConfigError, match=key):
            load_config(params, overrides)


def test_rollouts_without_sampler_logprobs_are_refused():
    with pytest.raises(ValueError, match="grpo.rollout_correction: none"):
        RolloutCorrection("token_mask").weights(TRAINER, None, WRITTEN)
