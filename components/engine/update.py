"""One GRPO optimisation step: which tokens count, the reference log-probs, the learning rate, and
`num_iterations` passes of clipped-surrogate updates over minibatches (gradient accumulation, several
processes) with the loss object the trainer built once.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from components.config import GRPOConfig
from components.engine.distributed import DistContext, all_reduce_sum, no_sync
from components.engine.objectives import GRPOLoss, build_loss, masked_mean
from components.engine.policy import Policy
from components.engine.rollout import Rollout, completion_logprobs


def learning_rate(step: int, g: GRPOConfig) -> float:
    """Linear warmup, then cosine decay to `min_lr_ratio` of the peak."""
    if step < g.warmup_steps:
        return g.learning_rate * (step + 1) / g.warmup_steps
    progress = (step - g.warmup_steps) / max(1, g.steps - g.warmup_steps)
    cosine = 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))
    return g.learning_rate * (g.min_lr_ratio + (1.0 - g.min_lr_ratio) * cosine)


def loss_mask(rollout: Rollout, scorable: torch.Tensor, mask_truncated: bool) -> torch.Tensor:
    """The completion tokens the loss sees: none of a completion no reward scored, nor (DAPO's
    `mask_truncated_completions`) of one cut off at max_completion_length without EOS."""
    keep = scorable
    if mask_truncated:
        keep = keep & ~rollout.truncated
    return rollout.completion_mask * keep.unsqueeze(-1).to(rollout.completion_mask.dtype)


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
    forward_seconds: float = 0.0  # where the update's time goes (logged as time/policy_forward, ...)
    backward_seconds: float = 0.0
    optimizer_seconds: float = 0.0


def minibatch_plan(n: int, g: GRPOConfig) -> list[list[int]]:
    """The global minibatches (row lists) of an n-row rollout, the same for any number of processes."""
    size = g.minibatch_size or n
    return [list(range(i, min(i + size, n))) for i in range(0, n, size)]


def local_rows(rows: list[int], group_size: int, ctx: DistContext) -> list[int]:
    """This rank's rows of a global minibatch: its groups, round-robin, each group whole on one rank."""
    if not ctx.active:
        return rows
    groups = sorted({r // group_size for r in rows})[ctx.rank::ctx.world]
    return [r for r in rows if r // group_size in set(groups)]


def _every_row(rows: list[int], n: int) -> bool:
    """Whether `rows` are all n rows in order (the usual single minibatch): then tensors are used as they are,
    since indexing with a list copies (about 15 us a tensor on the tiny default)."""
    return len(rows) == n and rows == list(range(n))


def _row_picker(rows: list[int], n: int) -> Callable[[torch.Tensor], torch.Tensor]:
    """t -> t[rows], decided once for all of a minibatch's tensors of n rows."""
    return (lambda t: t) if _every_row(rows, n) else (lambda t: t[rows])


def policy_updates(policy: Policy, optimizer, rollout: Rollout, advantages: torch.Tensor, mask: torch.Tensor,
                   ref_logp: torch.Tensor | None, g: GRPOConfig, ctx: DistContext = DistContext(),
                   scorable: torch.Tensor | None = None, loss: GRPOLoss | None = None) -> UpdateStats:
    """`num_iterations` passes over the rollout in minibatches, accumulating gradients per optimizer step.

    Loss normalisers (tokens for dapo, sequences for grpo/dr_grpo) are those of the whole accumulated
    chunk, so the accumulated gradient equals the full-chunk gradient. With one pass and one optimizer
    step the old log-probs are the current ones detached (ratio exactly 1) and no extra forward runs.

    With several processes every rank holds the whole (gathered) rollout but runs forward/backward only
    on its groups of each minibatch; the normalisers are the global chunk's, and the loss is multiplied
    by the world size because DDP averages gradients over ranks, so the summed update equals the
    one-process update on the same batch. A rank with no group in a minibatch backpropagates a zero
    loss so that DDP's collective still matches.

    `bnpo` differs from `dapo` only here: each minibatch is normalised by its own token count and the
    accumulated chunk is their mean (TRL divides by the accumulation steps); `dapo` uses the chunk's
    token count. Rows that no reward scored (`scorable` False) count in no normaliser.

    `loss` is the trainer's loss object (built once from config); without one it is built from `g`.
    """
    loss_fn = build_loss(g) if loss is None else loss
    n = len(rollout)
    minibatches = minibatch_plan(n, g)
    mine = [local_rows(mb, g.group_size, ctx) for mb in minibatches]
    per_step = g.gradient_accumulation_steps or len(minibatches)
    chunks = [list(range(i, min(i + per_step, len(minibatches)))) for i in range(0, len(minibatches), per_step)]
    module = policy.train_module
    old_logp = None
    if g.num_iterations > 1 or len(chunks) > 1:
        with torch.no_grad():
            if ctx.active:
                old_logp = torch.zeros(rollout.completion_ids.shape, dtype=torch.float32,
                                       device=rollout.completion_ids.device)
                for rows in mine:
                    if rows or ctx.lockstep:  # fsdp2: a rank without rows still joins the forward
                        part = completion_logprobs(policy.model, rollout.select(rows or [0]), g.temperature)[0]
                        if rows:
                            old_logp[rows] = part
            else:
                old_logp = torch.cat([policy.logprobs(rollout.select(mb), g.temperature)[0] for mb in minibatches])
    stats = UpdateStats()
    tokens_seen = 0.0
    grad_scale = float(ctx.world)  # DDP averages gradients over ranks; the loss is already a global sum
    for iteration in range(g.num_iterations):
        for chunk in chunks:
            rows = [r for k in chunk for r in minibatches[k]]
            take = _row_picker(rows, n)
            n_tokens = float(take(mask).sum())
            n_seq = float(len(rows)) if scorable is None else float(take(scorable).sum())
            # bnpo: each rank's share of each minibatch is a mean of its own; DDP then averages over ranks
            share = 1.0 / (len(chunk) * (ctx.world if ctx.active else 1)) if g.loss_type == "bnpo" else 1.0
            optimizer.zero_grad(set_to_none=True)
            chunk_loss = torch.zeros(())
            for j, k in enumerate(chunk):
                mb = mine[k]
                last = j == len(chunk) - 1
                if not mb:  # no group of this minibatch on this rank: a zero loss keeps DDP in step
                    with no_sync(module, skip=not last):
                        logp, _ = completion_logprobs(module, rollout.select(minibatches[k][:1]), g.temperature)
                        (torch.nan_to_num(logp).sum() * 0.0).backward()
                    continue
                sub = rollout if _every_row(mb, n) else rollout.select(mb)
                take = _row_picker(mb, n)
                sub_mask = take(mask)
                with no_sync(module, skip=ctx.active and not last):
                    t0 = time.perf_counter()
                    logp, entropy = policy.logprobs(sub, g.temperature, with_entropy=iteration == 0, module=module)
                    out = loss_fn(logp, take(old_logp) if old_logp is not None else logp.detach(),
                                  take(advantages), sub_mask,
                                  ref_logp=None if ref_logp is None else take(ref_logp), num_sequences=n_seq,
                                  num_tokens=float(sub_mask.sum()) if g.loss_type == "bnpo" else n_tokens)
                    part = out.loss * share
                    t1 = time.perf_counter()
                    (part * grad_scale if ctx.active else part).backward()
                    stats.forward_seconds += t1 - t0
                    stats.backward_seconds += time.perf_counter() - t1
                if iteration == 0:
                    weight = float(sub_mask.sum())
                    stats.entropy += float(masked_mean(entropy, sub_mask)) * weight
                    stats.logprob_mean += float((logp.detach() * sub_mask).sum())
                    tokens_seen += weight
                chunk_loss = chunk_loss + part.detach()
                stats.pg_loss += float(out.pg_loss) * share
                stats.kl += float(out.kl) * share
                stats.clip_low_frac += float(out.clip_low_frac) * len(mb) / n
                stats.clip_high_frac += float(out.clip_high_frac) * len(mb) / n
            t0 = time.perf_counter()
            grad_norm = torch.nn.utils.clip_grad_norm_(
                [p for p in policy.model.parameters() if p.requires_grad], g.max_grad_norm)
            if hasattr(grad_norm, "full_tensor"):  # fsdp2: a DTensor over the shards
                grad_norm = grad_norm.full_tensor()
            stats.updates += 1
            if ctx.active:  # the global chunk loss, so every rank takes the same skip decision
                chunk_loss = torch.tensor(all_reduce_sum(ctx, [float(chunk_loss)])[0])
            stats.loss += float(chunk_loss)
            stats.grad_norm = float(grad_norm)
            if not (torch.isfinite(chunk_loss) and torch.isfinite(grad_norm)):
                stats.skipped_updates += 1
                optimizer.zero_grad(set_to_none=True)
                stats.optimizer_seconds += time.perf_counter() - t0
                continue
            optimizer.step()
            stats.optimizer_seconds += time.perf_counter() - t0
    if ctx.active:  # each rank saw part of every chunk: sum the parts (normalisers were already global)
        sums = all_reduce_sum(ctx, [stats.pg_loss, stats.kl, stats.clip_low_frac, stats.clip_high_frac,
                                    stats.entropy, stats.logprob_mean, tokens_seen])
        stats.pg_loss, stats.kl, stats.clip_low_frac, stats.clip_high_frac = sums[:4]
        stats.entropy, stats.logprob_mean, tokens_seen = sums[4:]
    passes = max(1, stats.updates)
    stats.loss, stats.pg_loss, stats.kl = stats.loss / passes, stats.pg_loss / passes, stats.kl / passes
    stats.clip_low_frac /= g.num_iterations
    stats.clip_high_frac /= g.num_iterations
    stats.entropy /= max(tokens_seen, 1.0)
    stats.logprob_mean /= max(tokens_seen, 1.0)
    return stats


def reference_logprobs(policy: Policy, rollout: Rollout, g: GRPOConfig, ctx: DistContext) -> torch.Tensor:
    """Reference log-probs of the rows this process trains on (all rows in one process; zeros elsewhere)."""
    if not ctx.active:
        return policy.reference_logprobs(rollout, g.temperature)
    mine = sorted({r for mb in minibatch_plan(len(rollout), g) for r in local_rows(mb, g.group_size, ctx)})
    ref_logp = torch.zeros(rollout.completion_ids.shape, dtype=torch.float32, device=rollout.completion_ids.device)
    if mine or ctx.lockstep:  # fsdp2: a rank without rows still joins the forward
        part = policy.reference_logprobs(rollout.select(mine or [0]), g.temperature)
        if mine:
            ref_logp[mine] = part
    return ref_logp


def make_optimizer(model: torch.nn.Module, g: GRPOConfig, device: torch.device) -> torch.optim.Optimizer:
    """AdamW over the trainable parameters (the LoRA adapters alone with LoRA).

    The fused kernel updates every tensor in one pass (a per-tensor loop costs ~2 ms a step on the tiny model).
    """
    trainable = [p for p in model.parameters() if p.requires_grad]
    fused = device.type in ("cpu", "cuda") and all(p.is_floating_point() for p in trainable)
    return torch.optim.AdamW(trainable, lr=g.learning_rate, weight_decay=g.weight_decay, fused=fused or None)


def set_learning_rate(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr
