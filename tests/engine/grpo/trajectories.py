"""Building a step's trajectory by hand in engine tests, the way the grpo stage builds it."""

from __future__ import annotations

import torch

from components.config import GRPOConfig
from components.engine.generation.rollouts import Rollouts
from components.engine.grpo.policy import Policy
from components.engine.grpo.trajectory import Trajectory
from components.engine.grpo.update import UpdatePlan, old_logprobs


def trajectory(rollouts: Rollouts, advantages: torch.Tensor, mask: torch.Tensor | None = None,
               ref_logp: torch.Tensor | None = None, policy: Policy | None = None,
               g: GRPOConfig | None = None, scorable: torch.Tensor | None = None) -> Trajectory:
    """Every row scored unless `scorable` says otherwise; the loss sees `mask` (default: the completion tokens). With
    `policy` and `g` the sampling weights' log-probs are taken first when `g` moves the weights within the step."""
    old_logp = None
    if policy is not None and g is not None:
        plan = UpdatePlan.of(len(rollouts), rollouts.group_size, g)
        old_logp = old_logprobs(policy, rollouts, plan) if plan.needs_old_logprobs else None
    return Trajectory(rollouts, advantages, rollouts.completion_mask if mask is None else mask,
                      torch.ones(len(rollouts), dtype=torch.bool) if scorable is None else scorable, ref_logp, old_logp)
