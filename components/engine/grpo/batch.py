"""A GRPO step's batch: which prompts, G completions each through the policy's one `sample` door, their rewards, and
(DAPO's dynamic sampling) which groups to keep, refilled from extra prompts until the batch is full.

A round samples and scores some prompts' groups in one of two ways (`one_process_round` with the run's one generator;
`per_group_round`, a generator per group seeded from where it sits in the step, the groups shared between processes,
so any number of processes builds the same batch); `collect_batch` runs the rounds and keeps the groups. Two reward
vectors travel with the groups: `rewards` (what is logged) and `advantage_rewards` (what the advantages are formed
from).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from components.config import GRPOConfig, RewardSpec
from components.engine.generation.engines.base import SamplingParams
from components.engine.generation.rollouts import Rollouts, concat_rollouts
from components.engine.generation.scoring import Completions, score
from components.engine.grpo.objectives import build_loss
from components.engine.grpo.policy import Policy
from components.engine.parallel.distributed import DistContext, all_gather_objects, group_seed, shard
from components.engine.rewards.rewards import RewardError, RewardModel, RewardResult


def sampling_params(g: GRPOConfig) -> SamplingParams:
    """How rollouts are drawn. The one place the step reads `grpo.group_size`: from here on the rollouts carry it."""
    return SamplingParams(n=g.group_size, max_new_tokens=g.max_completion_length, temperature=g.temperature,
                          top_p=g.top_p, top_k=g.top_k)


def reward_specs(g: GRPOConfig) -> list[RewardSpec]:
    """The configured rewards, plus DAPO's overlong penalty when enabled."""
    specs = list(g.rewards)
    if g.overlong.enabled:
        specs.append(RewardSpec("overlong_penalty", 1.0, {"max_length": g.max_completion_length,
                                                          "buffer": g.overlong.buffer, "penalty": g.overlong.penalty}))
    return specs


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


@dataclass(frozen=True)
class ScoredGroups:
    """Some prompts' groups of completions and their rewards, row for row."""

    rollouts: Rollouts
    rewards: RewardResult  # what is logged: the weighted sum (`total`) and each reward's scores
    advantage_rewards: list[float]  # what the advantages are formed from (NaN: no reward scored the completion)
    reward_seconds: float  # time in the reward functions (kept apart from generation in the step timings)
    records: tuple[dict[str, Any], ...]  # each group's record, group for group

    def informative_groups(self) -> list[int]:
        """Groups whose scored rewards are not all equal (DAPO: the others have zero advantage)."""
        return informative_groups(self.advantage_rewards, self.rollouts.group_size)

    def keep(self, groups: Sequence[int]) -> ScoredGroups:
        rows = self.rollouts.group_rows(groups)
        return ScoredGroups(self.rollouts.select(rows), select_rewards(self.rewards, rows),
                            [self.advantage_rewards[r] for r in rows], self.reward_seconds,
                            tuple(self.records[k] for k in groups))


@dataclass(frozen=True)
class Batch:
    """What a step trains on, and what it logs about the sampling."""

    rollouts: Rollouts  # the kept groups' prompts and completions
    advantage_rewards: list[float]  # per kept completion, what its advantage is formed from (NaN: unscored)
    rewards: RewardResult  # the first round's rewards, every group: what the reward curves show
    sampled: int  # completions sampled, refills included
    reward_seconds: float
    records: tuple[dict[str, Any], ...]  # each kept group's record, group for group (dynamic sampling drops some)


RoundSampler = Callable[[int, list[int], int], list[ScoredGroups]]  # (step, record indices, round) -> its groups


def collect_batch(sample_round: RoundSampler, schedule: PromptSchedule, step: int, g: GRPOConfig,
                  pad_id: int) -> Batch:
    """The step's groups; with dynamic sampling, only (and, when filling, enough) informative ones."""
    ds = g.dynamic_sampling
    first = sample_round(step, schedule.indices(step), 0)
    kept = [part.keep(part.informative_groups()) if ds.enabled else part for part in first]
    sampled = sum(len(part.rollouts) for part in first)
    reward_seconds = sum(part.reward_seconds for part in first)
    attempt = 0
    while ds.enabled and ds.fill_batch and groups_in(kept) < g.prompts_per_step and attempt < ds.max_tries:
        extra = sample_round(step, schedule.extra(step, attempt, g.prompts_per_step - groups_in(kept)), attempt + 1)
        sampled += sum(len(part.rollouts) for part in extra)
        reward_seconds += sum(part.reward_seconds for part in extra)
        kept += [part.keep(part.informative_groups()) for part in extra]
        attempt += 1
    kept = [part for part in kept if len(part.rollouts)] or [first[0].keep([])]
    return Batch(concat_rollouts([part.rollouts for part in kept], pad_id),
                 [x for part in kept for x in part.advantage_rewards], merge_rewards([p.rewards for p in first]),
                 sampled, reward_seconds, tuple(r for part in kept for r in part.records))


def groups_in(parts: Sequence[ScoredGroups]) -> int:
    return sum(part.rollouts.num_groups for part in parts)


def one_process_round(policy: Policy, records: list[dict[str, Any]], params: SamplingParams, rewards: RewardModel,
                      g: GRPOConfig, generator: torch.Generator) -> RoundSampler:
    """Rounds sampled in this process, all groups in one `sample` call, drawing from the run's one generator."""

    def sample_round(_step: int, indices: list[int], _round: int) -> list[ScoredGroups]:
        chosen = [records[i] for i in indices]
        return score_groups(policy, [policy.sample(chosen, params, generator)], chosen, rewards, g)

    return sample_round


def per_group_round(policy: Policy, records: list[dict[str, Any]], params: SamplingParams, rewards: RewardModel,
                    g: GRPOConfig, seed: int, ctx: DistContext) -> RoundSampler:
    """Rounds with a generator per group, seeded from (seed, step, round, position in the round), so a group's
    completions are the same whichever process samples it: one process and N build the same batch. Each process
    samples and scores its groups (round-robin), then every process gets all groups, in prompt order.

    With a sharded model (`ctx.lockstep`) every process decodes the same number of groups (one short of a group
    samples a throwaway one) and its engine stops a group only when all processes' groups are done. Scoring runs
    inside the round on every process, so its time counts as generation (`reward_seconds` 0)."""

    def sample_round(step: int, indices: list[int], round_index: int) -> list[ScoredGroups]:
        positions = shard(list(range(len(indices))), ctx)
        rounds = -(-len(indices) // ctx.world) if ctx.lockstep else len(positions)
        local: list[tuple[int, ScoredGroups]] = []
        error = None
        try:
            device = next(policy.model.parameters()).device
            chosen = [records[indices[p]] for p in positions]
            parts = []
            for k in range(rounds):
                p, record = (positions[k], chosen[k]) if k < len(positions) else (0, records[indices[0]])
                generator = torch.Generator(device=device).manual_seed(group_seed(seed, step, round_index, p))
                part = policy.sample([record], params, generator)
                if k < len(positions):  # not the throwaway
                    parts.append(part.trimmed() if ctx.lockstep else part)
            if parts:
                scored = score_groups(policy, parts, chosen, rewards, g)
                local = [(p, on_device(s, "cpu")) for p, s in zip(positions, scored)]  # to travel between processes
        except RewardError as err:  # every process must learn of it, or the others would wait forever
            error = str(err)
        gathered = all_gather_objects(ctx, (local, error))
        errors = [e for _, e in gathered if e]
        if errors:
            raise RewardError(errors[0])
        device = next(policy.model.parameters()).device
        return [on_device(s, device) for _, s in sorted((x for items, _ in gathered for x in items),
                                                         key=lambda x: x[0])]

    return sample_round


def score_groups(policy: Policy, parts: list[Rollouts], records: list[dict[str, Any]], rewards: RewardModel,
                 g: GRPOConfig) -> list[ScoredGroups]:
    """Score rollouts of `records`' groups (one rollout per part, parts in record order) in one call of the rewards:
    each completion as the generation reads it (an episode's: its last turn, and the episode in columns of its own),
    the records' columns and each completion's token length (the model's tokens) passed along."""
    completions = Completions()
    for part in parts:
        completions.extend(Completions.of(part, policy.generation.read(part)))
    group_size = parts[0].group_size
    t0 = time.perf_counter()
    scored = score(rewards, records, completions, per_record=group_size)
    seconds = time.perf_counter() - t0
    totals = advantage_rewards(scored, g, group_size)
    out, start = [], 0
    for part in parts:
        rows, first_group = list(range(start, start + len(part))), start // group_size
        out.append(ScoredGroups(part, select_rewards(scored, rows) if len(parts) > 1 else scored,
                                totals[start:start + len(part)], seconds if start == 0 else 0.0,
                                tuple(records[first_group:first_group + part.num_groups])))
        start += len(part)
    return out


def advantage_rewards(scores: RewardResult, g: GRPOConfig, group_size: int) -> list[float]:
    """What a round's advantages are formed from, per completion (NaN: no reward scored it): the loss object's
    `advantage_rewards`, where GDPO's per-group normalisation lives."""
    return build_loss(g).advantage_rewards(scores, group_size)


def informative_groups(totals: Sequence[float], group_size: int) -> list[int]:
    """Indices of groups whose scored rewards are not all equal (DAPO: the others have zero advantage).

    NaN (unscored) rewards are ignored, so a group needs two scored completions that differ.
    """
    grouped = torch.tensor(list(totals)).view(-1, group_size)
    scored = ~torch.isnan(grouped)
    highest = torch.where(scored, grouped, torch.full_like(grouped, -math.inf)).max(1).values
    lowest = torch.where(scored, grouped, torch.full_like(grouped, math.inf)).min(1).values
    return torch.nonzero(highest > lowest).flatten().tolist()


def select_rewards(result: RewardResult, rows: Sequence[int]) -> RewardResult:
    """The given completions' rewards."""
    return RewardResult(total=[result.total[r] for r in rows],
                        components={k: [v[r] for r in rows] for k, v in result.components.items()},
                        scores=[[column[r] for r in rows] for column in result.scores], weights=list(result.weights))


def merge_rewards(parts: Sequence[RewardResult]) -> RewardResult:
    """Rewards of consecutive completions, in order."""
    if len(parts) == 1:
        return parts[0]
    return RewardResult(total=[x for p in parts for x in p.total],
                        components={k: [x for p in parts for x in p.components[k]] for k in parts[0].components},
                        scores=[[x for p in parts for x in p.scores[i]] for i in range(len(parts[0].scores))],
                        weights=list(parts[0].weights))


def on_device(groups: ScoredGroups, device: torch.device | str) -> ScoredGroups:
    """The groups' tensors on `device`; their reward time dropped (see `per_group_round`)."""
    return ScoredGroups(groups.rollouts.map(lambda t: t.to(device)), groups.rewards, groups.advantage_rewards, 0.0,
                        groups.records)
