"""A GRPO run's moving parts, built once before its first step: the loss (from config), the policy and its engine,
the optimizer with any resumed state, the rewards, the prompt schedule and how a round of groups is sampled.

The grpo stage reads as its loop because everything here is decided before it: several processes sample per group
and train through DDP (or FSDP2, sharded), one process samples every group in one call with the run's generator.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from components.config import PipelineConfig
from components.engine.grpo.batch import (
    PromptSchedule,
    RoundSampler,
    one_process_round,
    per_group_round,
    reward_specs,
    sampling_params,
)
from components.engine.grpo.memory_estimate import MemoryFit
from components.engine.grpo.objectives import GRPOLoss, build_loss
from components.engine.grpo.policy import Policy, build_policy
from components.engine.grpo.train_state import optimizer_and_resume
from components.engine.parallel.distributed import DistContext, all_true, wrap_ddp
from components.engine.rewards.rewards import RewardModel


@dataclass
class Training:
    """What the loop uses: built by `prepare_training`; `start_step` and `history` are where a resumed run stands."""

    policy: Policy
    loss: GRPOLoss
    optimizer: torch.optim.Optimizer
    rewards: RewardModel
    schedule: PromptSchedule
    sample_round: RoundSampler
    rollout_gen: torch.Generator  # the one-process sampler's generator (checkpointed)
    memory: MemoryFit
    moving_reference: bool  # the reference follows the policy (ema / periodic)
    start_step: int
    history: list[dict[str, Any]]

    @property
    def pad_id(self) -> int:
        return self.policy.tokenizer.pad_token_id


def prepare_training(cfg: PipelineConfig, start_dir: Path, records: list[dict[str, Any]], ctx: DistContext,
                     resume_from: Path | None, say: Callable[..., None] = print) -> Training:
    """Loss, policy (+ reference only if the loss has a KL term), optimizer and, from `resume_from`, the weights,
    optimizer state, RNGs and history of the run that stopped; then the sampler of a round. Several processes wrap
    the model for DDP last (FSDP2 sharded it while building the optimizer)."""
    g = cfg.grpo
    loss = build_loss(g)
    wrapped = ctx.active or cfg.distributed.per_group_sampling  # every forward the wrapper's, or N-independent
    policy, memory = build_policy(cfg, start_dir, torch.device("cpu") if ctx.lockstep else ctx.device, records,
                                  with_reference=loss.uses_reference, wrapped=wrapped,
                                  stop_together=(lambda done: all_true(ctx, done)) if ctx.lockstep else None, say=say)
    moving_reference = policy.reference is not None and g.reference.mode != "static"
    rewards = RewardModel(reward_specs(g), timeout_s=g.reward_timeout_s)
    schedule = PromptSchedule(len(records), g.prompts_per_step, cfg.seed)
    rollout_gen = torch.Generator(device=ctx.device).manual_seed(cfg.seed + 1)
    optimizer, state = optimizer_and_resume(policy, g, ctx, resume_from, moving_reference)
    start_step, history = (int(state["step"]), list(state["history"])) if state else (0, [])
    if state:
        rollout_gen.set_state(state["rollout_rng"])
        torch.set_rng_state(state["torch_rng"])
        say(f"grpo: resumed from {resume_from} at step {start_step}/{g.steps}")
    policy = distribute(policy, cfg, ctx, say)
    params = sampling_params(g)
    sample_round = per_group_round(policy, records, params, rewards, g, cfg.seed, ctx) if wrapped \
        else one_process_round(policy, records, params, rewards, g, rollout_gen)
    return Training(policy, loss, optimizer, rewards, schedule, sample_round, rollout_gen, memory, moving_reference,
                    start_step, history)


def distribute(policy: Policy, cfg: PipelineConfig, ctx: DistContext, say: Callable[..., None]) -> Policy:
    """The policy training through DDP (FSDP2 sharded it already); itself in one process."""
    g, backend = cfg.grpo, "nccl" if ctx.device.type == "cuda" else "gloo"
    if ctx.lockstep:
        say(f"grpo: {ctx.world} processes (FSDP2, {backend}): weights, gradients and optimizer state sharded; "
            f"{g.prompts_per_step} prompts per step shared between them")
    elif ctx.active:
        say(f"grpo: {ctx.world} processes (DDP, {backend}), {g.prompts_per_step} prompts per step shared between them")
        return policy.with_trainer(wrap_ddp(policy.model, ctx))
    return policy
