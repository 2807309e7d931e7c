"""One GRPO optimisation step: `num_iterations` passes of clipped-surrogate updates over a step's trajectory, in
minibatches (gradient accumulation) with the loss object the trainer built once.

Read `policy_updates` for the algorithm; several processes differ only inside the small helpers below it and in
components/engine/parallel/ (which rows a process trains on, DDP's gradient averaging, sums over processes).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from components.config import GRPOConfig
from components.engine.generation.rollouts import Rollouts
from components.engine.grpo.objectives import GRPOLoss, LossOutput, build_loss, high_entropy_mask, masked_mean
from components.engine.grpo.policy import Policy
from components.engine.grpo.rollout_correction import CorrectionStats
from components.engine.grpo.trajectory import Trajectory
from components.engine.parallel.distributed import (
    DistContext,
    all_gather_objects,
    all_reduce_sum,
    full_value,
    no_sync,
    zero_loss_backward,
)


@dataclass
class UpdateStats:
    loss: float = 0.0
    pg_loss: float = 0.0
    kl: float = 0.0
    clip_low_frac: float = 0.0
    clip_high_frac: float = 0.0
    grad_norm: float = 0.0
    entropy: float = 0.0
    logprob_mean: float = 0.0
    skipped_updates: int = 0
    updates: int = 0
    tokens_seen: float = 0.0  # loss tokens of the first pass (the entropy and log-prob means' weight)
    gap_sum: float = 0.0  # on-policy check: |sampler's log-prob - trainer's| summed over sampled tokens
    gap_max: float = 0.0
    gap_tokens: float = 0.0
    correction: CorrectionStats = field(default_factory=CorrectionStats)  # the rollout correction's weights
    forward_seconds: float = 0.0  # where the update's time goes (logged as time/policy_forward, ...)
    backward_seconds: float = 0.0
    optimizer_seconds: float = 0.0


@dataclass(frozen=True)
class UpdatePlan:
    """How a step's rows are cut: global minibatches (the same for any number of processes), this process's rows
    of each (its groups, round-robin, each group whole on one process) and the minibatches of each optimizer step."""

    minibatches: list[list[int]]
    mine: list[list[int]]
    steps: list[list[int]]  # minibatch indices accumulated into one optimizer step
    num_iterations: int

    @classmethod
    def of(cls, n: int, group_size: int, g: GRPOConfig, ctx: DistContext = DistContext()) -> UpdatePlan:
        """The plan of an n-row step whose groups are `group_size` adjacent rows."""
        size = g.minibatch_size or max(n, 1)  # a step whose every group dynamic sampling dropped has no rows
        minibatches = [list(range(i, min(i + size, n))) for i in range(0, n, size)]
        per_step = g.gradient_accumulation_steps or max(len(minibatches), 1)
        steps = [list(range(i, min(i + per_step, len(minibatches)))) for i in range(0, len(minibatches), per_step)]
        return cls(minibatches, [local_rows(mb, group_size, ctx) for mb in minibatches], steps, g.num_iterations)

    def rows(self, step: list[int]) -> list[int]:
        return [r for k in step for r in self.minibatches[k]]

    @property
    def my_rows(self) -> list[int]:
        """Every row this process trains on."""
        return sorted({r for rows in self.mine for r in rows})

    @property
    def needs_old_logprobs(self) -> bool:
        """Several passes or optimizer steps: the weights move before the last minibatch is seen, so the ratio
        needs the sampling weights' log-probs (with one of each they are the current ones, detached)."""
        return self.num_iterations > 1 or len(self.steps) > 1


def local_rows(rows: list[int], group_size: int, ctx: DistContext) -> list[int]:
    """This process's rows of a global minibatch: its groups, round-robin, each group whole on one process."""
    groups = set(sorted({r // group_size for r in rows})[ctx.rank::ctx.world])
    return [r for r in rows if r // group_size in groups]


def policy_updates(policy: Policy, optimizer, trajectory: Trajectory, g: GRPOConfig, loss: GRPOLoss | None = None,
                   plan: UpdatePlan | None = None, ctx: DistContext = DistContext()) -> UpdateStats:
    """`num_iterations` passes over the trajectory in minibatches, accumulating gradients per optimizer step.

    Loss normalisers (tokens for dapo, scored sequences for grpo/dr_grpo) are those of the whole accumulated
    step, so the accumulated gradient equals the one-pass gradient; a per-minibatch loss (bnpo) asks the loss
    object for its own. With one pass and one optimizer step the old log-probs are the current ones detached (ratio
    exactly 1) and no extra forward runs; otherwise the trajectory carries them (`old_logprobs`). With several
    processes each trains on its groups of every minibatch against the global normalisers. `loss` is the trainer's
    (built once from config); `plan` defaults to the trajectory's. The trajectory is only read.
    """
    loss_fn = build_loss(g) if loss is None else loss
    plan = plan or UpdatePlan.of(len(trajectory), trajectory.group_size, g, ctx)
    stats = UpdateStats()
    if plan.needs_old_logprobs:
        if trajectory.old_logp is None:
            raise ValueError("several passes or optimizer steps per rollout need the sampling weights' log-probs in "
                             "the trajectory (update.old_logprobs)")
        record_gap(stats, trajectory.old_logp, trajectory.rollouts, plan.my_rows)
    for iteration in range(g.num_iterations):
        for step in plan.steps:
            whole = trajectory.select(plan.rows(step))
            n_tokens, n_seq = float(whole.loss_mask.sum()), whole.scored_rows()
            share = loss_fn.minibatch_share(len(step) * ctx.world)
            optimizer.zero_grad(set_to_none=True)
            step_loss = torch.zeros(())
            for j, k in enumerate(step):
                rows, last = plan.mine[k], j == len(step) - 1
                if not rows:  # no group of this minibatch on this process: a zero loss keeps DDP in step
                    zero_loss_backward(lambda r: policy.logprobs(r)[0], policy.train_module,
                                       trajectory.rollouts.select(plan.minibatches[k][:1]), last)
                    continue
                part = trajectory.select(rows)
                num_tokens = loss_fn.token_count(n_tokens, float(part.loss_mask.sum()))
                with no_sync(policy.train_module, skip=not last):
                    out, scaled = forward_backward(policy, part, loss_fn, n_seq, num_tokens, share, iteration == 0,
                                                   ctx, stats)
                step_loss = step_loss + scaled.detach()
                record(stats, out, share, len(rows), len(trajectory))
            optimizer_step(policy, optimizer, step_loss, g.max_grad_norm, ctx, stats)
    return finish(stats, g.num_iterations, ctx)


def forward_backward(policy: Policy, part: Trajectory, loss_fn: GRPOLoss, n_seq: float, num_tokens: float,
                     share: float, first_pass: bool, ctx: DistContext,
                     stats: UpdateStats) -> tuple[LossOutput, torch.Tensor]:
    """The loss of a minibatch (this process's rows of it) and its backward; the first pass also records the
    tokens' entropy and log-prob. Several processes: DDP averages gradients, so each scales its part of the
    global sum by the number of processes."""
    t0 = time.perf_counter()
    logp, entropy = policy.logprobs(part.rollouts, with_entropy=first_pass or loss_fn.masks_by_entropy)
    if part.old_logp is None:  # the weights that sampled: the on-policy check compares its log-probs here
        record_gap(stats, logp.detach(), part.rollouts)
    old_logp = part.old_logp if part.old_logp is not None else logp.detach()
    token_mask = high_entropy_mask(entropy, part.loss_mask, loss_fn.top_entropy_quantile) \
        if loss_fn.masks_by_entropy else None
    if loss_fn.rollout_correction.enabled:  # the sampling weights' log-probs against the sampler's
        weight = loss_fn.rollout_correction.weights(old_logp, part.rollouts.sampling_logp, part.rollouts.written,
                                                    stats.correction if first_pass else None)
        token_mask = weight if token_mask is None else token_mask.to(weight.dtype) * weight
    out = loss_fn(logp, old_logp, part.advantages, part.loss_mask, ref_logp=part.ref_logp, num_sequences=n_seq,
                  num_tokens=num_tokens, token_mask=token_mask)
    scaled = out.loss * share
    t1 = time.perf_counter()
    (scaled * float(ctx.world)).backward()
    stats.forward_seconds += t1 - t0
    stats.backward_seconds += time.perf_counter() - t1
    if first_pass:
        weight = float(part.loss_mask.sum())
        stats.entropy += float(masked_mean(entropy, part.loss_mask)) * weight
        stats.logprob_mean += float((logp.detach() * part.loss_mask).sum())
        stats.tokens_seen += weight
    return out, scaled


def record_gap(stats: UpdateStats, trainer_logp: torch.Tensor, rollouts: Rollouts,
               rows: list[int] | None = None) -> None:
    """The on-policy check: how far the log-probs the update computes for the sampled tokens, with the weights
    that sampled them, are from those the sampler drew them with (the same model and maths: rounding only, unless
    a kernel, dtype or cache disagrees)."""
    if rollouts.sampling_logp is None:
        return
    sampled, mask = rollouts.sampling_logp, rollouts.written
    if rows is not None:
        sampled, mask, trainer_logp = sampled[rows], mask[rows], trainer_logp[rows]
    gap = (trainer_logp.float() - sampled)[mask].abs()
    if gap.numel():
        stats.gap_sum += float(gap.sum())
        stats.gap_max = max(stats.gap_max, float(gap.max()))
        stats.gap_tokens += gap.numel()


def record(stats: UpdateStats, out: LossOutput, share: float, rows: int, total_rows: int) -> None:
    stats.pg_loss += float(out.pg_loss) * share
    stats.kl += float(out.kl) * share
    stats.clip_low_frac += float(out.clip_low_frac) * rows / total_rows
    stats.clip_high_frac += float(out.clip_high_frac) * rows / total_rows


def optimizer_step(policy: Policy, optimizer, step_loss: torch.Tensor, max_grad_norm: float, ctx: DistContext,
                   stats: UpdateStats) -> None:
    """Clip, then step, unless the (global) loss or gradient norm is not finite: then the step is skipped and
    counted, the same decision on every process."""
    t0 = time.perf_counter()
    grad_norm = full_value(torch.nn.utils.clip_grad_norm_(
        [p for p in policy.model.parameters() if p.requires_grad], max_grad_norm))
    stats.updates += 1
    step_loss = torch.tensor(all_reduce_sum(ctx, [float(step_loss)])[0])
    stats.loss += float(step_loss)
    stats.grad_norm = float(grad_norm)
    if torch.isfinite(step_loss) and torch.isfinite(grad_norm):
        optimizer.step()
    else:
        stats.skipped_updates += 1
        optimizer.zero_grad(set_to_none=True)
    stats.optimizer_seconds += time.perf_counter() - t0


def finish(stats: UpdateStats, num_iterations: int, ctx: DistContext) -> UpdateStats:
    """Sums over processes (each saw part of every step; the normalisers were already global), then means."""
    sums = all_reduce_sum(ctx, [stats.pg_loss, stats.kl, stats.clip_low_frac, stats.clip_high_frac,
                                stats.entropy, stats.logprob_mean, stats.tokens_seen])
    stats.pg_loss, stats.kl, stats.clip_low_frac, stats.clip_high_frac = sums[:4]
    stats.entropy, stats.logprob_mean, stats.tokens_seen = sums[4:]
    stats.gap_sum, stats.gap_tokens = all_reduce_sum(ctx, [stats.gap_sum, stats.gap_tokens])
    stats.gap_max = max(all_gather_objects(ctx, stats.gap_max))
    c = stats.correction
    c.weight_sum, c.count, c.outside = all_reduce_sum(ctx, [c.weight_sum, c.count, c.outside])
    c.weight_min, c.weight_max = min(all_gather_objects(ctx, c.weight_min)), max(all_gather_objects(ctx, c.weight_max))
    passes = max(1, stats.updates)
    stats.loss, stats.pg_loss, stats.kl = stats.loss / passes, stats.pg_loss / passes, stats.kl / passes
    stats.clip_low_frac /= num_iterations
    stats.clip_high_frac /= num_iterations
    stats.entropy /= max(stats.tokens_seen, 1.0)
    stats.logprob_mean /= max(stats.tokens_seen, 1.0)
    return stats


def logprobs_of_rows(score: Callable[[Rollouts], torch.Tensor], rollouts: Rollouts, row_sets: list[list[int]],
                     lockstep: bool) -> torch.Tensor:
    """Log-probs [N, T] from `score`, one forward per set of rows, zeros in rows of no set; with a sharded model
    (fsdp2) a process whose set is empty still joins the forward (with one row)."""
    out = torch.zeros(rollouts.completion_ids.shape, dtype=torch.float32, device=rollouts.completion_ids.device)
    for rows in row_sets:
        if rows or lockstep:
            part = score(rollouts.select(rows or [0]))
            if rows:
                out[rows] = part
    return out


@torch.no_grad()
def old_logprobs(policy: Policy, rollouts: Rollouts, plan: UpdatePlan,
                 ctx: DistContext = DistContext()) -> torch.Tensor:
    """The sampling weights' log-probs of this process's rows, minibatch by minibatch, before any update."""
    return logprobs_of_rows(lambda rows: policy.logprobs(rows)[0], rollouts, plan.mine, ctx.lockstep)


def reference_logprobs(policy: Policy, rollouts: Rollouts, plan: UpdatePlan,
                       ctx: DistContext = DistContext()) -> torch.Tensor:
    """The reference's log-probs of the rows this process trains on, in one forward (zeros elsewhere)."""
    return logprobs_of_rows(lambda rows: policy.reference_logprobs(rows), rollouts, [plan.my_rows],
                            ctx.lockstep)
