"""Rollout correction: the policy-gradient term weighted for the sampler's log-probs differing from the trainer's.

The sampler (a half-precision decoder, a captured graph, another kernel) and the trainer's forward compute the
same model's log-probs with different rounding, so the completions are slightly off-policy for the weights being
trained. The correction weights each token's policy-gradient loss by the importance ratio
rho = exp(trainer log-prob - sampler log-prob) of the tokens the model wrote, per token or once per sequence
(the sum of its tokens' differences), and keeps rho in [min, max]: truncated (clamped) or masked (set to 0 outside).
Formula for formula TRL 1.16's `vllm_importance_sampling_correction` with `vllm_importance_sampling_mode`
token_truncate, token_mask, sequence_truncate or sequence_mask and `vllm_importance_sampling_clip_min/max`: the
trainer log-probs are those of the weights that sampled (detached), a missing sampler log-prob (NaN) counts as no
difference, and the weight multiplies the policy-gradient term only (after the entropy mask, before the KL term).
Cost: a few elementwise operations on [B, T]; no extra forward.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch

RolloutCorrectionMode = Literal["none", "token_truncate", "token_mask", "sequence_truncate", "sequence_mask"]


@dataclass
class CorrectionStats:
    """Sums over a step's rows, for the metrics: the applied weights' sum, count, min and max, and how many ratios
    fell outside [min, max] (truncated or masked). Token modes count the model's tokens, sequence modes rows."""

    weight_sum: float = 0.0
    count: float = 0.0
    weight_min: float = math.inf
    weight_max: float = -math.inf
    outside: float = 0.0

    def add(self, weights: torch.Tensor, outside: torch.Tensor) -> None:
        if weights.numel():
            self.weight_sum += float(weights.sum())
            self.count += weights.numel()
            self.weight_min = min(self.weight_min, float(weights.min()))
            self.weight_max = max(self.weight_max, float(weights.max()))
            self.outside += float(outside.sum())

    def metrics(self) -> dict[str, float]:
        """`rollout_correction/{ratio_mean,ratio_min,ratio_max,outside_frac}` (none when nothing was weighted)."""
        if not self.count:
            return {}
        return {"rollout_correction/ratio_mean": self.weight_sum / self.count,
                "rollout_correction/ratio_min": self.weight_min, "rollout_correction/ratio_max": self.weight_max,
                "rollout_correction/outside_frac": self.outside / self.count}


@dataclass(frozen=True)
class RolloutCorrection:
    """The correction's settings, read once from `grpo.rollout_correction*` (`from_config`)."""

    mode: RolloutCorrectionMode = "none"
    max_ratio: float | None = 3.0
    min_ratio: float | None = None

    @classmethod
    def from_config(cls, g) -> RolloutCorrection:
        return cls(g.rollout_correction, g.rollout_correction_max, g.rollout_correction_min)

    @property
    def enabled(self) -> bool:
        return self.mode != "none"

    def weights(self, trainer_logp: torch.Tensor, sampling_logp: torch.Tensor | None, written: torch.Tensor,
                stats: CorrectionStats | None = None) -> torch.Tensor:
        """The weights [B, T] (token modes) or [B, 1] (sequence modes) of rows whose trainer log-probs (detached,
        the sampling weights') and sampler log-probs are [B, T], over the model's tokens `written`; `stats` gathers
        the metrics when given."""
        if sampling_logp is None:
            raise ValueError("grpo.rollout_correction needs the sampler's log-prob of every drawn token, and these "
                             "rollouts carry none (greedy decoding, or an engine that does not keep them): set "
                             "grpo.rollout_correction: none")
        mask = written.to(trainer_logp.dtype)
        diff = ((trainer_logp.detach() - sampling_logp.to(trainer_logp.dtype)) * mask).nan_to_num(nan=0.0)
        sequence_level = self.mode.startswith("sequence")
        if sequence_level:
            diff = diff.sum(-1, keepdim=True)
        ratio = diff.exp()
        low = -math.inf if self.min_ratio is None else self.min_ratio
        high = math.inf if self.max_ratio is None else self.max_ratio
        outside = (ratio < low) | (ratio > high)
        if self.mode.endswith("truncate"):
            weight = ratio.clamp(min=self.min_ratio, max=self.max_ratio)
        else:
            weight = ratio.masked_fill(outside, 0.0)
        if stats is not None:
            seen = torch.ones_like(outside) if sequence_level else written.bool()
            stats.add(weight[seen], outside[seen])
        return weight
