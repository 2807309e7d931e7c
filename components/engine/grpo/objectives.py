"""GRPO objective: advantages, KL estimators and the policy loss built from a loss entry (components/losses.py),
as pure tensor math.

Nothing here knows about models or data, so every formula is unit-tested against hand-computed
numbers (tests/engine/grpo/test_objectives.py). Shapes: B sequences, T completion positions; `mask` is 1 on
real completion tokens and 0 on padding.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import torch

from components.engine.grpo.rollout_correction import RolloutCorrection
from components.losses import LOSSES, Loss, LossName, Normalisers

if TYPE_CHECKING:
    from components.config import GRPOConfig
    from components.engine.rewards.rewards import RewardResult

MultiObjective = Literal["sum_then_normalize", "normalize_then_sum"]
ScaleRewards = Literal["group", "batch", "none"]
KLEstimator = Literal["k1", "k2", "k3"]


def group_advantages(rewards: torch.Tensor, group_size: int, scale: ScaleRewards = "group",
                     eps: float = 1e-4) -> torch.Tensor:
    """A_i = r_i - mean(group), divided by the group std (GRPO), the batch std, or nothing (Dr. GRPO).

    `rewards` is flat with each prompt's `group_size` completions adjacent. Standard deviations are
    unbiased (n - 1), as in TRL, so results compare one to one. A NaN reward marks a completion that no
    reward function scored (all returned None): it is left out of its group's mean and std and gets
    advantage 0, as in TRL.
    """
    if rewards.numel() % group_size:
        raise ValueError(f"{rewards.numel()} rewards do not split into groups of {group_size}")
    if torch.isnan(rewards).any():
        return _nan_aware_advantages(rewards, group_size, scale, eps)
    grouped = rewards.view(-1, group_size)
    centred = grouped - grouped.mean(dim=1, keepdim=True)
    if scale == "group":
        centred = centred / (grouped.std(dim=1, keepdim=True) + eps)
    elif scale == "batch":
        centred = centred / (rewards.std() + eps)
    elif scale != "none":
        raise ValueError(f"unknown scale_rewards {scale!r}")
    return centred.reshape(-1)


def _nanstd(x: torch.Tensor, dim: int | None = None, keepdim: bool = False) -> torch.Tensor:
    """Unbiased std over the non-NaN entries (NaN where fewer than two)."""
    valid = ~torch.isnan(x)
    count = valid.sum() if dim is None else valid.sum(dim=dim, keepdim=keepdim)
    mean = x.nanmean() if dim is None else x.nanmean(dim=dim, keepdim=True)
    squares = torch.where(valid, (x - mean) ** 2, torch.zeros_like(x))
    total = squares.sum() if dim is None else squares.sum(dim=dim, keepdim=keepdim)
    return (total / (count - 1)).sqrt()


def _nan_aware_advantages(rewards: torch.Tensor, group_size: int, scale: ScaleRewards, eps: float) -> torch.Tensor:
    grouped = rewards.view(-1, group_size)
    centred = grouped - grouped.nanmean(dim=1, keepdim=True)
    if scale == "group":
        centred = centred / (_nanstd(grouped, dim=1, keepdim=True) + eps)
    elif scale == "batch":
        centred = centred / (_nanstd(rewards) + eps)
    elif scale != "none":
        raise ValueError(f"unknown scale_rewards {scale!r}")
    return torch.nan_to_num(centred.reshape(-1), nan=0.0)


def normalize_then_sum(scores: torch.Tensor, weights: torch.Tensor, group_size: int,
                       eps: float = 1e-4) -> torch.Tensor:
    """GDPO (TRL's `multi_objective_aggregation: normalize_then_sum`): each reward [N, K] column centred and scaled
    within its group, then the weighted sum [N].

    A reward of a large scale then cannot drown the others. NaN (a reward that did not apply) is left out of its
    group's statistics and counts 0 in the sum; a row that no reward scored stays NaN (advantage 0 later).
    """
    grouped = scores.view(-1, group_size, scores.shape[-1])
    mean = grouped.nanmean(dim=1, keepdim=True)
    std = _nanstd(grouped, dim=1, keepdim=True)
    normalised = ((grouped - mean) / (std + eps)).view(-1, scores.shape[-1])
    total = (normalised * weights.to(scores.dtype)).nansum(dim=1)
    return total.masked_fill(torch.isnan(scores).all(dim=1), float("nan"))


def batch_advantages(rewards: torch.Tensor, eps: float = 1e-4) -> torch.Tensor:
    """(r - batch mean) / (batch std + eps), NaN-aware; NaN rows get 0. GDPO's last step over normalised sums."""
    centred = (rewards - rewards.nanmean()) / (_nanstd(rewards) + eps)
    return torch.nan_to_num(centred, nan=0.0)


def high_entropy_mask(entropy: torch.Tensor, mask: torch.Tensor, quantile: float) -> torch.Tensor:
    """The completion tokens whose entropy is in the top `quantile` of the tokens under `mask` ("Beyond the 80/20
    rule", 2506.01939; TRL's `top_entropy_quantile`): entropy >= the (1 - quantile) quantile, padding never.

    `quantile` 1 keeps every token; 0 keeps only the highest-entropy token(s)."""
    real = mask.bool()
    values = entropy.detach()[real].float()
    if values.numel() == 0:
        return torch.zeros_like(real)
    threshold = torch.quantile(values, 1.0 - quantile)
    return (entropy.detach() >= threshold) & real


def kl_estimate(logp: torch.Tensor, ref_logp: torch.Tensor, estimator: KLEstimator = "k3") -> torch.Tensor:
    """Per-token estimate of KL(pi || pi_ref) from samples of pi (Schulman, "Approximating KL").

    With log r = log pi_ref - log pi: k1 = -log r, k2 = (log r)^2 / 2, k3 = r - 1 - log r (>= 0).
    """
    log_r = ref_logp - logp
    if estimator == "k1":
        return -log_r
    if estimator == "k2":
        return 0.5 * log_r.pow(2)
    if estimator == "k3":
        return torch.exp(log_r) - 1.0 - log_r
    raise ValueError(f"unknown kl_estimator {estimator!r}")


@dataclass
class LossOutput:
    """The scalar loss and detached diagnostics of one policy-loss evaluation."""

    loss: torch.Tensor
    pg_loss: torch.Tensor
    kl: torch.Tensor
    clip_low_frac: torch.Tensor
    clip_high_frac: torch.Tensor
    ratio_mean: torch.Tensor


def policy_loss(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
                objective: GRPOLoss, ref_logp: torch.Tensor | None = None, counts: Normalisers | None = None,
                token_mask: torch.Tensor | None = None) -> LossOutput:
    """The surrogate of `objective`'s loss entry (components/losses.py), with that entry's own settings, plus
    beta * KL, aggregated as that loss does over `counts` (default: the given rows, T as the maximum length).

    rho is exp(logp - old_logp) per token, or (GSPO) exp of its masked mean per sequence. `token_mask` weights the
    policy-gradient term per token ([B, T], or [B, 1] for a whole sequence): entropy masking's 0 or 1, multiplied by the
    rollout correction's weight; the KL term and every normaliser still count all of `mask`'s tokens, as in TRL.
    """
    loss, settings = objective.entry, objective.settings
    maskf = mask.to(logp.dtype)
    log_ratio = logp - old_logp
    if objective.importance_sampling_level == "sequence":
        log_ratio = ((log_ratio * maskf).sum(-1) / maskf.sum(-1).clamp(min=1.0)).unsqueeze(-1)
    elif objective.importance_sampling_level != "token":
        raise ValueError(f"unknown importance_sampling_level {objective.importance_sampling_level!r}")
    ratio = torch.exp(log_ratio)
    adv = advantages.unsqueeze(-1)
    pg_per_token = loss.surrogate(ratio, logp, adv, settings).expand_as(logp)
    if token_mask is not None:
        pg_per_token = pg_per_token * token_mask.to(logp.dtype)
    counts = counts if counts is not None else Normalisers(logp.shape[-1])
    pg_loss = loss.aggregation(pg_per_token, maskf, counts)
    beta = objective.beta
    if beta > 0.0:
        if ref_logp is None:
            raise ValueError("beta > 0 needs reference log-probs")
        kl = loss.aggregation(kl_estimate(logp, ref_logp, objective.kl_estimator), maskf, counts)
        total = pg_loss + beta * kl
    else:
        kl = torch.zeros((), dtype=logp.dtype)
        total = pg_loss
    with torch.no_grad():
        ratio_tok = ratio.expand_as(logp)
        low, high = loss.clip_statistics(ratio_tok, adv, settings)
        n = maskf.sum().clamp(min=1.0)
        stats = dict(clip_low_frac=(low * maskf).sum() / n, clip_high_frac=(high * maskf).sum() / n,
                     ratio_mean=(ratio_tok * maskf).sum() / n)
    return LossOutput(loss=total, pg_loss=pg_loss.detach(), kl=kl.detach(), **stats)


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of per-token `values` (e.g. entropies) at real completion positions (mask 1)."""
    maskf = mask.to(values.dtype)
    return (values * maskf).sum() / maskf.sum().clamp(min=1.0)


@dataclass(frozen=True)
class GRPOLoss:
    """The GRPO objective with its settings bound once from config (`build_loss`): the loss entry and its own
    settings record, the importance-sampling level, the KL term, and how rewards become advantages.

    The trainer and `--dry-run` call the same object, and `uses_reference` is the one place that
    decides whether there is a KL term (and so a reference model and reference log-probs at all).
    """

    loss_type: LossName
    settings: Any  # the entry's own settings record (components/losses.py), e.g. `ClipRange`
    importance_sampling_level: Literal["token", "sequence"] = "token"
    beta: float = 0.0
    kl_estimator: KLEstimator = "k3"
    max_completion_length: int | None = None  # the dr_grpo normaliser (None: each call's T)
    scale_rewards: ScaleRewards = "group"
    baseline: bool = True  # False for REINFORCE: the advantage is the reward itself
    multi_objective: MultiObjective = "sum_then_normalize"
    top_entropy_quantile: float = 1.0
    rollout_correction: RolloutCorrection = RolloutCorrection()  # weights for the sampler-trainer gap

    def __post_init__(self) -> None:
        if not isinstance(self.settings, self.entry.settings):
            raise TypeError(f"loss {self.loss_type!r} reads a {self.entry.settings.__name__}, "
                            f"not a {type(self.settings).__name__}")

    @property
    def entry(self) -> Loss:
        """The loss's entry in the table (components/losses.py)."""
        return LOSSES[self.loss_type]

    @property
    def uses_reference(self) -> bool:
        return self.beta > 0.0

    @property
    def masks_by_entropy(self) -> bool:
        """The policy-gradient term sees only the highest-entropy tokens (the update then needs entropies)."""
        return self.top_entropy_quantile < 1.0

    def token_count(self, step_tokens: float, minibatch_tokens: float) -> float:
        """What a token-mean aggregation divides a minibatch's sum by: the whole accumulated step's loss tokens, or
        (a per-minibatch loss such as bnpo) the minibatch's own."""
        return minibatch_tokens if LOSSES[self.loss_type].per_minibatch else step_tokens

    def minibatch_share(self, minibatches: int) -> float:
        """The weight of one minibatch's loss in its optimizer step (`minibatches`: how many make the step, every
        process's counted): 1, or for a per-minibatch loss 1 / minibatches (the step is their mean, as TRL)."""
        return 1.0 / minibatches if LOSSES[self.loss_type].per_minibatch else 1.0

    def advantage_rewards(self, scores: RewardResult, group_size: int) -> list[float]:
        """What a scored round's advantages are formed from, per completion (NaN: no reward scored it): the
        weighted sum of the rewards, or (GDPO, `normalize_then_sum`) each reward normalised within its group first,
        then summed by weight. The one place GDPO's per-group step runs; `advantages` scales its sums over the
        batch. Groups are whole in every round, so this is per round (dynamic sampling judges groups on it)."""
        if self.multi_objective == "sum_then_normalize":
            return scores.advantage_rewards()
        table = torch.tensor([[math.nan if s is None else s for s in column] for column in scores.scores],
                             dtype=torch.float32).T
        return normalize_then_sum(table, torch.tensor(scores.weights), group_size).tolist()

    def advantages(self, rewards: torch.Tensor, group_size: int) -> torch.Tensor:
        """Advantages of rewards [N] (`advantage_rewards`, laid out in groups of `group_size` adjacent rows):
        group-relative (NaN: unscored, advantage 0), the raw reward without a baseline, or (normalize_then_sum:
        rewards already normalised per group and summed) the sums scaled over the batch."""
        if not self.baseline:
            return torch.nan_to_num(rewards, nan=0.0)
        if not len(rewards):
            return rewards
        if self.multi_objective == "normalize_then_sum":
            return batch_advantages(rewards)
        return group_advantages(rewards, group_size, self.scale_rewards)

    def __call__(self, logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
                 ref_logp: torch.Tensor | None = None, num_sequences: float | None = None,
                 num_tokens: float | None = None, token_mask: torch.Tensor | None = None) -> LossOutput:
        """`policy_loss` of these rows, normalised by the accumulated step's `num_sequences` and `num_tokens`."""
        counts = Normalisers(self.max_completion_length if self.max_completion_length is not None
                             else logp.shape[-1], num_sequences, num_tokens)
        return policy_loss(logp, old_logp, advantages, mask, self, ref_logp if self.uses_reference else None,
                           counts, token_mask)


def build_loss(g: GRPOConfig) -> GRPOLoss:
    """`grpo.*` settings -> the loss object: the chosen entry gets its own settings record, read from the keys of
    the same names."""
    return GRPOLoss(loss_type=g.loss_type, settings=LOSSES[g.loss_type].settings_from(g),
                    importance_sampling_level=g.importance_sampling_level, beta=g.kl_beta,
                    kl_estimator=g.kl_estimator, max_completion_length=g.max_completion_length,
                    scale_rewards=g.scale_rewards, baseline=g.algorithm != "reinforce",
                    multi_objective=g.multi_objective_aggregation, top_entropy_quantile=g.top_entropy_quantile,
                    rollout_correction=RolloutCorrection.from_config(g))
