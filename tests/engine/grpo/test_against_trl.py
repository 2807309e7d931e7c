"""CISPO, SAPO, entropy masking and multi-reward normalisation against TRL 1.16's own code, number for number.

TRL's loss is `GRPOTrainer._compute_loss` itself, called on a stand-in trainer that holds only the settings it
reads (one process, no accumulation) and hands it our per-token log-probs as the model's; the loss and its
gradient with respect to those log-probs must equal ours. TRL forms multi-reward advantages inline in
`_generate_and_score_completions`; that block of its source is run as it is on the same reward table.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import textwrap
import types
from collections import defaultdict

import pytest
import torch

from components.config import GRPOConfig, RewardSpec
from components.engine.grpo.batch import advantage_rewards
from components.engine.grpo.objectives import build_loss, high_entropy_mask
from components.engine.rewards.rewards import RewardResult
from components.losses import LOSSES

if importlib.util.find_spec("trl") is None:
    pytest.skip("TRL is the reference (pip install trl==1.16.0)", allow_module_level=True)


def trl_module(name: str) -> types.ModuleType:
    """TRL's `trl.trainer.<name>`, imported by the first test that reads it, not at collection: there both
    workers would import TRL (seconds of CPU each) for the one that runs this file."""
    return importlib.import_module(f"trl.trainer.{name}")


# Two groups of two completions, three positions, one padded: ratios on both sides of every clip range,
# two of them above a cap of 1.4 (CISPO), with advantages of both signs.
MASK = torch.tensor([[1, 1, 1], [1, 1, 0], [1, 1, 1], [1, 0, 0]], dtype=torch.float32)
OLD = torch.tensor([[-0.5, -1.0, -2.0], [-1.5, -0.3, -0.7], [-0.2, -0.9, -1.1], [-2.0, -0.4, -0.6]])
RATIOS = torch.tensor([[1.5, 0.9, 1.1], [0.6, 1.05, 3.0], [0.7, 1.3, 1.0], [1.25, 2.0, 2.0]])
REF = OLD + torch.tensor([[0.1, -0.2, 0.3], [0.0, 0.4, -0.1], [-0.3, 0.2, 0.1], [0.2, 0.0, 0.5]])
ADVANTAGES = torch.tensor([0.7071, -0.7071, 0.7071, -0.7071])
ENTROPIES = torch.tensor([[0.9, 0.1, 2.0], [0.4, 1.6, 0.0], [1.1, 0.3, 0.8], [2.5, 0.2, 0.6]])


class OneProcess:
    """accelerate's collectives with a single process: the identity."""

    num_processes = 1

    def gather(self, t):
        return t

    def reduce(self, t, reduction="sum"):
        return t

    def pad_across_processes(self, t, dim=0, pad_index=0):
        return t


def trl_loss(logp: torch.Tensor, *, loss_type: str, epsilon_low=0.2, epsilon_high=0.28, beta=0.0,
             level="token", sapo=(1.0, 1.05), top_entropy_quantile=1.0, metrics: dict | None = None) -> torch.Tensor:
    """`GRPOTrainer._compute_loss` on our inputs (`logp` stands for the model's per-token log-probs); what it logs
    goes into `metrics` when given."""
    args = types.SimpleNamespace(delta=None, use_bias_correction_kl=False, sapo_temperature_pos=sapo[0],
                                 sapo_temperature_neg=sapo[1], steps_per_generation=1)
    trainer = types.SimpleNamespace(
        args=args, loss_type=loss_type, epsilon_low=epsilon_low, epsilon_high=epsilon_high, beta=beta,
        importance_sampling_level=level, top_entropy_quantile=top_entropy_quantile, off_policy_mask_threshold=None,
        use_vllm=False, vllm_importance_sampling_correction=False, model=types.SimpleNamespace(training=True),
        current_gradient_accumulation_steps=1, accelerator=OneProcess(), max_completion_length=MASK.shape[1],
        _entropy_bonus_enabled=False, aux_loss_enabled=False,
        _metrics={"train": defaultdict(list) if metrics is None else metrics})
    trainer._get_per_token_logps_and_entropies = lambda *a, **k: (logp, ENTROPIES, None)
    trainer.get_high_entropy_mask = types.MethodType(trl_module("grpo_trainer").GRPOTrainer.get_high_entropy_mask,
                                                     trainer)
    n = len(MASK)
    inputs = {"prompt_ids": torch.zeros(n, 1, dtype=torch.long), "prompt_mask": torch.ones(n, 1, dtype=torch.long),
              "completion_ids": torch.zeros(MASK.shape, dtype=torch.long), "completion_mask": MASK,
              "advantages": ADVANTAGES, "old_per_token_logps": OLD, "ref_per_token_logps": REF,
              "num_items_in_batch": MASK.sum()}
    return trl_module("grpo_trainer").GRPOTrainer._compute_loss(trainer, None, inputs)


def ours(logp: torch.Tensor, *, loss_type: str, epsilon_low=0.2, epsilon_high=0.28, beta=0.0, level="token",
         sapo=(1.0, 1.05), top_entropy_quantile=1.0, cispo_max_ratio=5.0) -> torch.Tensor:
    g = GRPOConfig(loss_type=loss_type, epsilon=epsilon_low,
                   epsilon_high=None if loss_type == "cispo" else epsilon_high, kl_beta=beta,
                   importance_sampling_level=level, sapo_temperature_pos=sapo[0],
                   sapo_temperature_neg=sapo[1], top_entropy_quantile=top_entropy_quantile,
                   cispo_max_ratio=cispo_max_ratio, max_completion_length=MASK.shape[1])
    loss = build_loss(g)
    token_mask = high_entropy_mask(ENTROPIES, MASK, top_entropy_quantile) if loss.masks_by_entropy else None
    return loss(logp, OLD, ADVANTAGES, MASK, ref_logp=REF, token_mask=token_mask).loss


def loss_and_grad(fn, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    logp = (OLD + torch.log(RATIOS)).requires_grad_(True)
    loss = fn(logp, **kwargs)
    (grad,) = torch.autograd.grad(loss, logp)
    return loss.detach(), grad * MASK  # padded positions carry no gradient in either (TRL's may be -0.0)


def assert_same(**kwargs) -> None:
    trl_kwargs = {k: v for k, v in kwargs.items() if k != "cispo_max_ratio"}
    if kwargs.get("loss_type") == "cispo":  # TRL reads CISPO's cap from epsilon_high
        trl_kwargs["epsilon_high"] = kwargs.get("cispo_max_ratio", 5.0)
    expected_loss, expected_grad = loss_and_grad(trl_loss, **trl_kwargs)
    loss, grad = loss_and_grad(ours, **kwargs)
    torch.testing.assert_close(loss, expected_loss, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(grad, expected_grad, rtol=1e-6, atol=1e-7)


# What TRL logs as a loss's clip statistics: (low, high) metric names, or None where it logs none (a soft gate).
TRL_CLIP_METRICS = {"cispo": (None, "cispo_clip_ratio"), "sapo": None}


@pytest.mark.parametrize("beta", [0.0, 0.04])
@pytest.mark.parametrize("loss_type", list(LOSSES))
def test_every_loss_in_the_table_matches_trls_of_the_same_name(loss_type, beta):
    """Each entry of components/losses.py against TRL's loss type of its name: loss, gradient and the clip
    statistics TRL logs (token level). A new entry is compared here without another line."""
    kwargs = dict(loss_type=loss_type, beta=beta, cispo_max_ratio=1.4)
    assert_same(**kwargs)
    logp = OLD + torch.log(RATIOS)
    metrics: dict = defaultdict(list)
    trl_loss(logp, loss_type=loss_type, beta=beta, epsilon_high=1.4 if loss_type == "cispo" else 0.28,
             metrics=metrics)
    g = GRPOConfig(loss_type=loss_type, epsilon=0.2, epsilon_high=None if loss_type == "cispo" else 0.28,
                   kl_beta=beta, cispo_max_ratio=1.4, max_completion_length=MASK.shape[1])
    out = build_loss(g)(logp, OLD, ADVANTAGES, MASK, ref_logp=REF)
    names = TRL_CLIP_METRICS.get(loss_type, ("clip_ratio/low_mean", "clip_ratio/high_mean"))
    low, high = (None, None) if names is None else names
    assert out.clip_low_frac.item() == pytest.approx(metrics[low][0] if low else 0.0, abs=1e-7)
    assert out.clip_high_frac.item() == pytest.approx(metrics[high][0] if high else 0.0, abs=1e-7)
    assert names is None or metrics[names[1]][0] > 0, "the fixture's ratios never clip: nothing was compared"


@pytest.mark.parametrize("cap", [1.4, 5.0])
@pytest.mark.parametrize("beta", [0.0, 0.04])
@pytest.mark.parametrize("level", ["token", "sequence"])
def test_cispo_matches_trl(cap, beta, level):
    assert_same(loss_type="cispo", cispo_max_ratio=cap, beta=beta, level=level)


def test_cispo_still_gives_clipped_tokens_a_gradient():
    """The point of CISPO: a token whose weight is capped keeps a gradient (the clipped surrogate's is zero)."""
    _, cispo = loss_and_grad(ours, loss_type="cispo", cispo_max_ratio=1.4)
    _, clipped = loss_and_grad(ours, loss_type="dapo", epsilon_high=0.2)
    assert clipped[0, 0] == 0 and cispo[0, 0] != 0  # ratio 1.5 > 1.4 and > 1.2, positive advantage


@pytest.mark.parametrize("temperatures", [(1.0, 1.05), (0.5, 2.0)])
@pytest.mark.parametrize("beta", [0.0, 0.04])
@pytest.mark.parametrize("level", ["token", "sequence"])
def test_sapo_matches_trl(temperatures, beta, level):
    assert_same(loss_type="sapo", sapo=temperatures, beta=beta, level=level)


@pytest.mark.parametrize("quantile", [0.0, 0.2, 0.5, 0.8])
@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "dr_grpo", "cispo", "sapo"])
def test_entropy_masking_matches_trl(quantile, loss_type):
    assert_same(loss_type=loss_type, top_entropy_quantile=quantile, beta=0.04)


@pytest.mark.parametrize("quantile", [0.0, 0.2, 0.5, 1.0])
def test_entropy_mask_is_trls(quantile):
    trainer = types.SimpleNamespace(accelerator=OneProcess())
    expected = trl_module("grpo_trainer").GRPOTrainer.get_high_entropy_mask(trainer, ENTROPIES, MASK, 1 - quantile)
    assert torch.equal(high_entropy_mask(ENTROPIES, MASK, quantile), expected)


def test_entropy_mask_by_hand():
    """10 real tokens; the top 20% by entropy are 2.5 and 2.0 (the 0.8 quantile is 1.68); padding never."""
    kept = high_entropy_mask(ENTROPIES, MASK, 0.2)
    assert kept.nonzero().tolist() == [[0, 2], [3, 0]]


def trl_advantages(table: torch.Tensor, weights: list[float], aggregation: str, scale: str,
                   group_size: int) -> torch.Tensor:
    """The multi-reward block of TRL's `_generate_and_score_completions`, run from its own source."""
    source = inspect.getsource(trl_module("grpo_trainer").GRPOTrainer._generate_and_score_completions)
    start = source.index('        if self.multi_objective_aggregation == "sum_then_normalize":')
    end = source.index("        advantages = torch.nan_to_num(advantages, nan=0.0)")
    end = source.index("\n", end)
    block = textwrap.dedent(source[start:end])
    trainer = types.SimpleNamespace(multi_objective_aggregation=aggregation, scale_rewards=scale,
                                    reward_weights=torch.tensor(weights), reward_funcs=[None] * len(weights))
    scope = {"self": trainer, "torch": torch, "nanstd": trl_module("utils").nanstd, "rewards_per_func": table,
             "num_generations": group_size, "device": "cpu", "unscorable_mask": torch.isnan(table).all(dim=1)}
    exec(compile(block, "trl-grpo-advantages", "exec"), scope)  # noqa: S102 - TRL's pinned source
    return scope["advantages"]


# Two rewards of very different scales (a 0/1 answer, a 0..100 length score), a None, and a row no reward scored.
TABLE = [[1.0, 80.0], [0.0, 10.0], [1.0, None], [0.0, 30.0], [None, None], [1.0, 95.0], [0.0, 20.0], [1.0, 5.0]]


@pytest.mark.parametrize("aggregation,scale", [("sum_then_normalize", "group"), ("sum_then_normalize", "batch"),
                                               ("sum_then_normalize", "none"), ("normalize_then_sum", "group"),
                                               ("normalize_then_sum", "batch")])
@pytest.mark.parametrize("weights", [[1.0, 1.0], [2.0, 0.5]])
def test_multi_reward_advantages_match_trl(aggregation, scale, weights):
    g = GRPOConfig(group_size=4, scale_rewards=scale, multi_objective_aggregation=aggregation,
                   rewards=[RewardSpec("exact_match", weights[0]), RewardSpec("length", weights[1])])
    columns = [[row[k] for row in TABLE] for k in range(2)]
    total = [sum(w * s for w, s in zip(weights, row) if s is not None) for row in TABLE]
    result = RewardResult(total=total, components={"a": columns[0], "b": columns[1]}, scores=columns, weights=weights)
    advantages = build_loss(g).advantages(torch.tensor(advantage_rewards(result, g, 4)), 4)
    table = torch.tensor([[float("nan") if s is None else s for s in row] for row in TABLE])
    torch.testing.assert_close(advantages, trl_advantages(table, weights, aggregation, scale, 4), rtol=1e-5, atol=1e-6)


def test_normalize_then_sum_lets_the_small_reward_count():
    """Group 2 (rows 4-7): summing first ranks the wrong, longer row 6 (0 + 20) above the right, short row 7 (1 + 5):
    the 0/1 reward drowns in the 0..100 one. Normalised within the group first, the right answer ranks higher."""
    g = GRPOConfig(group_size=4, rewards=[RewardSpec("exact_match"), RewardSpec("length")])
    columns = [[row[k] for row in TABLE] for k in range(2)]
    total = [sum(s for s in row if s is not None) for row in TABLE]
    result = RewardResult(total=total, components={"a": columns[0], "b": columns[1]}, scores=columns,
                          weights=[1.0, 1.0])
    summed = build_loss(g).advantages(torch.tensor(advantage_rewards(result, g, 4)), 4)
    g.multi_objective_aggregation = "normalize_then_sum"
    gdpo = build_loss(g).advantages(torch.tensor(advantage_rewards(result, g, 4)), 4)
    assert summed[7] < summed[6]
    assert gdpo[7] > gdpo[6]
    assert summed[4] == gdpo[4] == 0  # no reward scored row 4: advantage 0 either way
