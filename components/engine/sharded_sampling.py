"""GRPO rollouts sharded over ranks: one seeded sampler per prompt group, groups gathered in prompt order.

Used when training runs on several processes (or `distributed.per_group_sampling` is on): each
group's completions depend only on (seed, step, round, prompt position), never on which rank drew
them, so N processes build exactly the batch one process builds.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from components.config import GRPOConfig
from components.engine.distributed import DistContext, all_gather_objects, all_true, group_seed, shard
from components.data.records import reward_columns
from components.stages.grpo import Policy, PromptSchedule, informative_groups
from components.engine.rewards import RewardError, RewardModel, RewardResult
from components.engine.rollout import Rollout, concat_rollouts, decode_completions, sample_groups


def _trim(rollout: Rollout) -> Rollout:
    """Drop trailing all-padding completion columns (decoding in lockstep runs past this group's EOS)."""
    used = rollout.completion_mask.any(0).nonzero()
    width = int(used[-1]) + 1 if len(used) else 0
    return Rollout(rollout.prompt_ids, rollout.prompt_mask, rollout.completion_ids[:, :width],
                   rollout.completion_mask[:, :width], rollout.truncated)


def _on(rollout: Rollout, device: torch.device | str) -> Rollout:
    return Rollout(rollout.prompt_ids.to(device), rollout.prompt_mask.to(device), rollout.completion_ids.to(device),
                   rollout.completion_mask.to(device), rollout.truncated.to(device))


@dataclass
class GroupSample:
    """One prompt's G completions and their scores; `position` is its place in the round's prompt list."""

    position: int
    rollout: Rollout  # on the CPU, so it can travel between ranks
    totals: list[float]
    components: dict[str, list[float | None]]


def sample_round(policy: Policy, records: list[dict[str, Any]], indices: list[int], g: GRPOConfig,
                 rewards: RewardModel, seed: int, step: int, attempt: int, ctx: DistContext) -> list[GroupSample]:
    """Sample and score one round with a sampler per group; every rank returns all groups in prompt order.

    Each group's generator is seeded from (seed, step, round, position), so its completions are the
    same whichever rank samples it: one process and N processes see the same batch. Each rank samples
    and scores only its groups (round-robin), then the groups are gathered.

    With a sharded model (`ctx.lockstep`) every rank decodes the same number of groups (a rank short
    of one samples a throwaway group) and stops a group only when all ranks' groups are done.
    """
    local: list[GroupSample] = []
    error = None
    positions = shard(list(range(len(indices))), ctx)
    stop_together = (lambda done: all_true(ctx, done)) if ctx.lockstep else None
    rounds = -(-len(indices) // ctx.world) if ctx.lockstep else len(positions)
    try:
        device = next(policy.model.parameters()).device
        recs = [records[indices[p]] for p in positions]
        parts = []
        for k in range(rounds):
            p, rec = (positions[k], recs[k]) if k < len(positions) else (0, records[indices[0]])  # or a throwaway
            gen = torch.Generator(device=device).manual_seed(group_seed(seed, step, attempt, p))
            part = sample_groups(policy.model, policy.tokenizer, [policy.format_prompt(rec)], g.group_size,
                                 g.max_completion_length, temperature=g.temperature, top_p=g.top_p,
                                 generator=gen, stop_together=stop_together)
            if k < len(positions):
                parts.append(_trim(part) if ctx.lockstep else part)
        if parts:
            completions = [text for part in parts for text in decode_completions(policy.tokenizer, part)]
            columns = reward_columns(recs, g.group_size)
            columns["completion_token_lengths"] = [int(x) for part in parts for x in part.completion_mask.sum(-1)]
            scored = rewards([r["prompt"] for r in recs for _ in range(g.group_size)], completions, columns)
            size = g.group_size
            for i, (p, part) in enumerate(zip(positions, parts)):
                local.append(GroupSample(p, _on(part, "cpu"), scored.advantage_rewards()[i * size:(i + 1) * size],
                                         {k: v[i * size:(i + 1) * size] for k, v in scored.components.items()}))
    except RewardError as err:  # every rank must learn of it, or the others would wait forever
        error = str(err)
    gathered = all_gather_objects(ctx, (local, error))
    errors = [e for _, e in gathered if e]
    if errors:
        raise RewardError(errors[0])
    return sorted((s for items, _ in gathered for s in items), key=lambda s: s.position)


def collect_batch_sharded(policy: Policy, records: list[dict[str, Any]], schedule: PromptSchedule, step: int,
                          g: GRPOConfig, rewards: RewardModel, seed: int, ctx: DistContext
                          ) -> tuple[Rollout, list[float], RewardResult, int]:
    """`collect_batch` with per-group samplers, sampling sharded over ranks; the same batch for any N.

    Dynamic sampling decides on the gathered (global) groups, so the kept count and the refill rounds
    are global too.
    """
    groups = sample_round(policy, records, schedule.indices(step), g, rewards, seed, step, 0, ctx)
    first = RewardResult(total=[0.0 if math.isnan(x) else x for s in groups for x in s.totals],  # as RewardModel's
                         components={k: [x for s in groups for x in s.components[k]] for k in groups[0].components})
    sampled = len(first.total)

    def informative(s: GroupSample) -> bool:
        return bool(informative_groups(s.totals, g.group_size))

    ds = g.dynamic_sampling
    kept = [s for s in groups if not ds.enabled or informative(s)]
    attempt = 0
    while ds.enabled and ds.fill_batch and len(kept) < g.prompts_per_step and attempt < ds.max_tries:
        extra = sample_round(policy, records, schedule.extra(step, attempt, g.prompts_per_step - len(kept)), g,
                             rewards, seed, step, attempt + 1, ctx)
        sampled += len(extra) * g.group_size
        kept += [s for s in extra if informative(s)]
        attempt += 1
    device = next(policy.model.parameters()).device
    rollout = concat_rollouts([s.rollout for s in kept], policy.tokenizer.pad_token_id) if kept \
        else groups[0].rollout.select([])
    return _on(rollout, device), [x for s in kept for x in s.totals], first, sampled
