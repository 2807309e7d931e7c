"""A GRPO step's batch: which prompts, G completions each, their rewards, and (DAPO) which groups to keep.

Two samplers build the same kind of `Batch`. `collect_batch` samples all groups in one process with
one generator (prompt-once forwards). `collect_batch_sharded` gives each prompt group a sampler of its
own, seeded from (seed, step, round, position), and shares the groups between ranks: one process
and N processes then build exactly the same batch (`distributed.per_group_sampling`, and always
with more than one process).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, replace
from typing import Any

import torch

from components.config import GRPOConfig, RewardSpec
from components.data.records import reward_columns
from components.engine.grpo.objectives import normalize_then_sum
from components.engine.grpo.policy import Policy
from components.engine.grpo.trajectory import by_group, group_rows
from components.engine.models.rollout import Rollout, concat_rollouts, decode_completions, sample_groups
from components.engine.parallel.distributed import DistContext, all_gather_objects, all_true, group_seed, shard
from components.engine.rewards.rewards import RewardError, RewardModel, RewardResult


class PromptSchedule:
    """Which prompts step k uses: a fresh seeded permutation per epoch, a pure function of the step.

    Being a function of the step alone, resume needs no data-loader state. Extra prompts for DAPO's
    batch filling come from `extra`, seeded by the step, so they are just as reproducible.
    """

    def __init__(self, n: int, per_step: int, seed: int):
        self.n, self.per_step, self.seed = n, per_step, seed
        self._perms: dict[int, list[int]] = {}

    def _perm(self, epoch: int) -> list[int]:
        if epoch not in self._perms:
            gen = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._perms = {epoch: torch.randperm(self.n, generator=gen).tolist()}
        return self._perms[epoch]

    def indices(self, step: int) -> list[int]:
        start = step * self.per_step
        return [self._perm(k // self.n)[k % self.n] for k in range(start, start + self.per_step)]

    def extra(self, step: int, attempt: int, count: int) -> list[int]:
        gen = torch.Generator().manual_seed(self.seed * 7_919 + step * 101 + attempt)
        return torch.randint(0, self.n, (count,), generator=gen).tolist()


def reward_specs(g: GRPOConfig) -> list[RewardSpec]:
    """The configured rewards, plus DAPO's overlong penalty when enabled."""
    specs = list(g.rewards)
    if g.overlong.enabled:
        specs.append(RewardSpec("overlong_penalty", 1.0, {"max_length": g.max_completion_length,
                                                          "buffer": g.overlong.buffer, "penalty": g.overlong.penalty}))
    return specs


@dataclass
class Batch:
    """What a step trains on, and what it logs about the sampling."""

    rollout: Rollout  # the kept groups' prompts and completions
    totals: list[float]  # what the kept completions' advantages are formed from (`advantage_rewards`; NaN: unscored)
    first_scores: RewardResult  # the first round's scores, every group (what the reward curves show)
    sampled: int  # completions sampled, refills included
    reward_seconds: float  # time in the reward functions (kept apart from generation in the step timings)


@dataclass
class ScoredRollout:
    rollout: Rollout
    completions: list[str]
    rewards: RewardResult
    reward_seconds: float


def sample_and_score(policy: Policy, records: list[dict[str, Any]], g: GRPOConfig, rewards: RewardModel,
                     generator: torch.Generator) -> ScoredRollout:
    prompts = [r["prompt"] for r in records]
    rollout = sample_groups(policy.model, policy.tokenizer, [policy.format_prompt(r) for r in records], g.group_size,
                            g.max_completion_length,
                            temperature=g.temperature, top_p=g.top_p, top_k=g.top_k, generator=generator, fast=policy.fast)
    completions = decode_completions(policy.tokenizer, rollout)
    columns = reward_columns(records, g.group_size)
    columns["completion_token_lengths"] = rollout.completion_mask.sum(-1).tolist()
    expanded = [p for p in prompts for _ in range(g.group_size)]
    t0 = time.perf_counter()
    scores = rewards(expanded, completions, columns)
    return ScoredRollout(rollout, completions, scores, time.perf_counter() - t0)


def advantage_rewards(scores: RewardResult, g: GRPOConfig) -> list[float]:
    """What a step's advantages are formed from, per completion (NaN: no reward scored it): the weighted sum of
    the rewards, or (`multi_objective_aggregation: normalize_then_sum`) each reward normalised within its group
    first, then summed by weight (GDPO). Groups are whole in every scored round, so this is per round."""
    if g.multi_objective_aggregation == "sum_then_normalize":
        return scores.advantage_rewards()
    table = torch.tensor([[math.nan if s is None else s for s in column] for column in scores.scores],
                         dtype=torch.float32).T
    return normalize_then_sum(table, torch.tensor(scores.weights), g.group_size).tolist()


def informative_groups(total: list[float], group_size: int) -> list[int]:
    """Indices of groups whose scored rewards are not all equal (DAPO: the others have zero advantage).

    NaN (unscored) rewards are ignored, so a group needs two scored completions that differ.
    """
    grouped = by_group(torch.tensor(total), group_size)
    scored = ~torch.isnan(grouped)
    highest = torch.where(scored, grouped, torch.full_like(grouped, -math.inf)).max(1).values
    lowest = torch.where(scored, grouped, torch.full_like(grouped, math.inf)).min(1).values
    return torch.nonzero(highest > lowest).flatten().tolist()


def collect_batch(policy: Policy, records: list[dict[str, Any]], schedule: PromptSchedule, step: int, g: GRPOConfig,
                  rewards: RewardModel, generator: torch.Generator) -> Batch:
    """The step's rollout and rewards; with dynamic sampling, only (and, when filling, enough) informative groups."""
    first = sample_and_score(policy, [records[i] for i in schedule.indices(step)], g, rewards, generator)
    first_totals = advantage_rewards(first.rewards, g)
    if not g.dynamic_sampling.enabled:
        return Batch(first.rollout, first_totals, first.rewards, len(first.completions), first.reward_seconds)
    parts, totals, sampled, reward_seconds = [], [], len(first.completions), first.reward_seconds
    keep = informative_groups(first_totals, g.group_size)
    parts.append(first.rollout.select(group_rows(keep, g.group_size)))
    totals += [first_totals[i] for i in group_rows(keep, g.group_size)]
    attempt, kept = 0, len(keep)
    while g.dynamic_sampling.fill_batch and kept < g.prompts_per_step and attempt < g.dynamic_sampling.max_tries:
        extra = sample_and_score(policy, [records[i] for i in schedule.extra(step, attempt, g.prompts_per_step - kept)],
                                 g, rewards, generator)
        sampled += len(extra.completions)
        reward_seconds += extra.reward_seconds
        extra_totals = advantage_rewards(extra.rewards, g)
        more = informative_groups(extra_totals, g.group_size)
        parts.append(extra.rollout.select(group_rows(more, g.group_size)))
        totals += [extra_totals[i] for i in group_rows(more, g.group_size)]
        kept += len(more)
        attempt += 1
    return Batch(concat_rollouts(parts, policy.tokenizer.pad_token_id), totals, first.rewards, sampled,
                 reward_seconds)


def _trim(rollout: Rollout) -> Rollout:
    """Drop trailing all-padding completion columns (decoding in lockstep runs past this group's EOS)."""
    used = rollout.completion_mask.any(0).nonzero()
    width = int(used[-1]) + 1 if len(used) else 0
    return replace(rollout, completion_ids=rollout.completion_ids[:, :width],
                   completion_mask=rollout.completion_mask[:, :width],
                   sampling_logp=None if rollout.sampling_logp is None else rollout.sampling_logp[:, :width])


def _on(rollout: Rollout, device: torch.device | str) -> Rollout:
    return rollout.map(lambda t: t.to(device))


@dataclass
class GroupSample:
    """One prompt's G completions and their scores; `position` is its place in the round's prompt list."""

    position: int
    rollout: Rollout  # on the CPU, so it can travel between ranks
    totals: list[float]  # what the advantages are formed from (`advantage_rewards`)
    components: dict[str, list[float | None]]
    weighted: list[float]  # the weighted sums, as `RewardResult.total` (the logged reward)


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
                                 g.max_completion_length, temperature=g.temperature, top_p=g.top_p, top_k=g.top_k,
                                 generator=gen, stop_together=stop_together)
            if k < len(positions):
                parts.append(_trim(part) if ctx.lockstep else part)
        if parts:
            completions = [text for part in parts for text in decode_completions(policy.tokenizer, part)]
            columns = reward_columns(recs, g.group_size)
            columns["completion_token_lengths"] = [int(x) for part in parts for x in part.completion_mask.sum(-1)]
            scored = rewards([r["prompt"] for r in recs for _ in range(g.group_size)], completions, columns)
            size, totals = g.group_size, advantage_rewards(scored, g)
            for i, (p, part) in enumerate(zip(positions, parts)):
                rows = slice(i * size, (i + 1) * size)
                local.append(GroupSample(p, _on(part, "cpu"), totals[rows],
                                         {k: v[rows] for k, v in scored.components.items()}, scored.total[rows]))
    except RewardError as err:  # every rank must learn of it, or the others would wait forever
        error = str(err)
    gathered = all_gather_objects(ctx, (local, error))
    errors = [e for _, e in gathered if e]
    if errors:
        raise RewardError(errors[0])
    return sorted((s for items, _ in gathered for s in items), key=lambda s: s.position)


def collect_batch_sharded(policy: Policy, records: list[dict[str, Any]], schedule: PromptSchedule, step: int,
                          g: GRPOConfig, rewards: RewardModel, seed: int, ctx: DistContext) -> Batch:
    """`collect_batch` with per-group samplers, sampling sharded over ranks; the same batch for any N.

    Scoring happens inside each group's round, so its time is counted as generation (`reward_seconds` 0).

    Dynamic sampling decides on the gathered (global) groups, so the kept count and the refill rounds
    are global too.
    """
    groups = sample_round(policy, records, schedule.indices(step), g, rewards, seed, step, 0, ctx)
    first = RewardResult(total=[x for s in groups for x in s.weighted],
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
    return Batch(_on(rollout, device), [x for s in kept for x in s.totals], first, sampled, 0.0)
