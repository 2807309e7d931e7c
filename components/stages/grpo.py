"""Stage `grpo`: Group Relative Policy Optimization, readable top to bottom.

Each step: pick prompts -> sample G completions per prompt -> score them -> (DAPO) keep informative
groups -> group-relative advantages -> reference log-probs once -> `num_iterations` passes of
clipped-surrogate updates over minibatches -> update the reference (ema/periodic) -> log ->
checkpoint. Resumes from the newest complete checkpoint trained from the same inputs; on CPU with a
fixed seed a resumed run ends with the same weights.
"""

from __future__ import annotations

import copy
import csv
import dataclasses
import json
import math
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from components.data.checkpoints import discard_foreign, latest_checkpoint, load_checkpoint, save_checkpoint
from components.config import (ConfigError, GRPOConfig, LoRAConfig, PipelineConfig, RewardSpec, config_warnings,
                               stage_params_hash, to_flat_dict)
from components.data.records import dir_md5, file_md5, read_jsonl, reward_columns, split_path
from components.engine.distributed import (DistContext, all_reduce_sum, barrier, init, launch, needs_launch, no_sync, shutdown,
                                    tracking_run, wrap_ddp)
from components.engine.fastlm import PrefixSharedLM
from components.engine.modeling import load_policy_model, load_tokenizer, pick_device, resolve_model_dir, save_model, seed_everything
from components.engine.objectives import group_advantages, masked_entropy, policy_loss
from components.data.paths import Paths
from components.engine.prompting import PromptFormatter
from components.tracking.reports import GRPOReporter
from components.engine.rewards import RewardError, RewardModel, RewardResult
from components.engine.rollout import Rollout, completion_logprobs, concat_rollouts, decode_completions, sample_groups
from components.interruptions import set_progress
from components.stages.cli import StageFailed, stage_main

MAX_BAD_STEPS = 3
# Wall-clock metrics differ run to run; they stay out of checkpoints so checkpoints are byte-reproducible.
TIMING_KEYS = ("step_seconds", "completions_per_s", "time/generation", "time/reward", "time/reference", "time/policy")
StepCallback = Callable[[int, Any, dict[str, float]], None]


def learning_rate(step: int, g: GRPOConfig) -> float:
    """Linear warmup, then cosine decay to `min_lr_ratio` of the peak."""
    if step < g.warmup_steps:
        return g.learning_rate * (step + 1) / g.warmup_steps
    progress = (step - g.warmup_steps) / max(1, g.steps - g.warmup_steps)
    cosine = 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))
    return g.learning_rate * (g.min_lr_ratio + (1.0 - g.min_lr_ratio) * cosine)


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


@torch.no_grad()
def update_reference(reference, policy, mode: str, step: int, ema_alpha: float, sync_every: int) -> bool:
    """ema: ref <- (1 - a) ref + a policy every step; periodic: copy every `sync_every` steps; static: never."""
    for module in (reference, policy):
        if hasattr(module, "reshard"):  # fsdp2: a root may stay gathered after forward; work on the shards
            module.reshard()
    if mode == "ema":
        for r, p in zip(reference.parameters(), policy.parameters()):
            r.mul_(1.0 - ema_alpha).add_(p.detach(), alpha=ema_alpha)
        return True
    if mode == "periodic" and (step + 1) % sync_every == 0:
        reference.load_state_dict(policy.state_dict())
        return True
    return False


def attach_lora(model, lora: LoRAConfig):
    """Wrap `model` with peft LoRA adapters; refuse target modules the model does not have."""
    names = {name.rsplit(".", 1)[-1] for name, _ in model.named_modules()}
    missing = [m for m in lora.target_modules if m not in names]
    if missing:
        raise ConfigError(f"grpo.lora.target_modules: {missing} not found in the model "
                          f"(it has e.g. {sorted(n for n in names if n and not n.isdigit())[:12]})")
    from peft import LoraConfig, get_peft_model

    return get_peft_model(model, LoraConfig(r=lora.rank, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                                            target_modules=list(lora.target_modules), task_type="CAUSAL_LM"))


@dataclass
class Policy:
    """The model being trained and how to get reference log-probs for it."""

    tokenizer: Any
    model: Any
    reference: Any | None  # a separate frozen model, or None (no KL, or LoRA: adapters disabled)
    lora: bool
    format_prompt: Callable[[dict[str, Any]], str] = lambda record: record["prompt"]
    fast: PrefixSharedLM | None = None  # prompt-once forwards over `model` (None: plain Hugging Face forward)
    fast_reference: PrefixSharedLM | None = None
    trainer: Any | None = None  # the module gradient forwards go through (DDP wrapper); default `model`

    @property
    def train_module(self):
        return self.model if self.trainer is None else self.trainer

    def logprobs(self, rollout: Rollout, temperature: float, return_logits: bool = False,
                 module: Any | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Completion log-probs through `module` (default: `model`), prompt-once when `fast` is set.

        Distributed runs clear `fast`: DDP and FSDP need every forward to go through their wrapper.
        """
        if self.fast is not None:
            return self.fast.completion_logprobs(rollout, temperature, return_logits)
        return completion_logprobs(self.model if module is None else module, rollout, temperature, return_logits)

    def reference_logprobs(self, rollout: Rollout, temperature: float) -> torch.Tensor:
        """Once per rollout under inference_mode; cloned outside it so the loss can use the result."""
        with torch.inference_mode():
            if self.lora:
                with self.model.disable_adapter():
                    logp = self.logprobs(rollout, temperature)[0]
            elif self.fast_reference is not None:
                logp = self.fast_reference.completion_logprobs(rollout, temperature)[0]
            else:
                logp = completion_logprobs(self.reference, rollout, temperature)[0]
        return logp.clone()


def longest_row(tokenizer: Any, format_prompt: Callable[[dict[str, Any]], str], records: list[dict[str, Any]],
                completion_length: int) -> int:
    """Tokens in the longest prompt + completion row GRPO will see (the prompt-once forward checks that long)."""
    longest = max((len(tokenizer(format_prompt(r), add_special_tokens=False).input_ids) for r in records), default=1)
    return longest + completion_length


def build_policy(cfg: PipelineConfig, start_dir: Path, device: torch.device,
                 records: list[dict[str, Any]] | None = None) -> Policy:
    """Policy, reference and prompt-once forwards; `records` (the prompts) size the forward's self-check."""
    g = cfg.grpo
    tokenizer = load_tokenizer(start_dir, cfg.model.trust_remote_code)
    model = load_policy_model(cfg, start_dir, device)
    reference = None
    if g.lora.enabled:
        model = attach_lora(model, g.lora)
    elif g.kl_beta > 0:
        reference = load_policy_model(cfg, g.reference.path, device) if g.reference.path else copy.deepcopy(model)
        reference.eval().requires_grad_(False)
    policy = Policy(tokenizer, model.train(), reference, g.lora.enabled, PromptFormatter(cfg.prompt, tokenizer))
    if g.prefix_sharing:
        max_length = longest_row(tokenizer, policy.format_prompt, records, g.max_completion_length) if records else None
        policy.fast = PrefixSharedLM.for_model(model, len(tokenizer), max_length, g.max_completion_length)
        if policy.fast is None:
            print(f"grpo: prefix sharing off: {type(model).__name__} is not a Llama-family model with full "
                  "attention, no attention dropout and log-probs that match Hugging Face's; using the plain forward")
        elif reference is not None:
            policy.fast_reference = policy.fast.for_same_architecture(reference)
    return policy


@dataclass
class ScoredRollout:
    rollout: Rollout
    prompts: list[str]  # one per completion
    completions: list[str]
    rewards: RewardResult
    reward_seconds: float  # time spent in the reward functions (kept apart from generation in the step timings)


def sample_and_score(policy: Policy, records: list[dict[str, Any]], g: GRPOConfig, rewards: RewardModel,
                     generator: torch.Generator) -> ScoredRollout:
    prompts = [r["prompt"] for r in records]
    rollout = sample_groups(policy.model, policy.tokenizer, [policy.format_prompt(r) for r in records], g.group_size,
                            g.max_completion_length,
                            temperature=g.temperature, top_p=g.top_p, generator=generator, fast=policy.fast)
    completions = decode_completions(policy.tokenizer, rollout)
    columns = reward_columns(records, g.group_size)
    columns["completion_token_lengths"] = rollout.completion_mask.sum(-1).tolist()
    expanded = [p for p in prompts for _ in range(g.group_size)]
    t0 = time.perf_counter()
    scores = rewards(expanded, completions, columns)
    return ScoredRollout(rollout, expanded, completions, scores, time.perf_counter() - t0)


def informative_groups(total: list[float], group_size: int) -> list[int]:
    """Indices of groups whose scored rewards are not all equal (DAPO: the others have zero advantage).

    NaN (unscored) rewards are ignored, so a group needs two scored completions that differ.
    """
    grouped = torch.tensor(total).view(-1, group_size)
    scored = ~torch.isnan(grouped)
    highest = torch.where(scored, grouped, torch.full_like(grouped, -math.inf)).max(1).values
    lowest = torch.where(scored, grouped, torch.full_like(grouped, math.inf)).min(1).values
    return torch.nonzero(highest > lowest).flatten().tolist()


def rows_of(groups: list[int], group_size: int) -> list[int]:
    return [g * group_size + j for g in groups for j in range(group_size)]


def collect_batch(policy: Policy, records: list[dict[str, Any]], schedule: PromptSchedule, step: int, g: GRPOConfig,
                  rewards: RewardModel, generator: torch.Generator
                  ) -> tuple[Rollout, list[float], RewardResult, int, float]:
    """The step's rollout and rewards; with dynamic sampling, only (and, when filling, enough) informative groups.

    Returns (rollout, total rewards (NaN where no reward scored the completion), the first round's
    scores for logging, completions sampled, seconds spent in reward functions).
    """
    first = sample_and_score(policy, [records[i] for i in schedule.indices(step)], g, rewards, generator)
    first_totals = first.rewards.advantage_rewards()
    if not g.dynamic_sampling.enabled:
        return first.rollout, first_totals, first.rewards, len(first.completions), first.reward_seconds
    parts, totals, sampled, reward_seconds = [], [], len(first.completions), first.reward_seconds
    keep = informative_groups(first_totals, g.group_size)
    parts.append(first.rollout.select(rows_of(keep, g.group_size)))
    totals += [first_totals[i] for i in rows_of(keep, g.group_size)]
    attempt, kept = 0, len(keep)
    while g.dynamic_sampling.fill_batch and kept < g.prompts_per_step and attempt < g.dynamic_sampling.max_tries:
        extra = sample_and_score(policy, [records[i] for i in schedule.extra(step, attempt, g.prompts_per_step - kept)],
                                 g, rewards, generator)
        sampled += len(extra.completions)
        reward_seconds += extra.reward_seconds
        extra_totals = extra.rewards.advantage_rewards()
        more = informative_groups(extra_totals, g.group_size)
        parts.append(extra.rollout.select(rows_of(more, g.group_size)))
        totals += [extra_totals[i] for i in rows_of(more, g.group_size)]
        kept += len(more)
        attempt += 1
    return concat_rollouts(parts, policy.tokenizer.pad_token_id), totals, first.rewards, sampled, reward_seconds


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


def policy_updates(policy: Policy, optimizer, rollout: Rollout, advantages: torch.Tensor, mask: torch.Tensor,
                   ref_logp: torch.Tensor | None, g: GRPOConfig, ctx: DistContext = DistContext(),
                   scorable: torch.Tensor | None = None) -> UpdateStats:
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
    """
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
    eps_high = g.epsilon if g.epsilon_high is None else g.epsilon_high
    stats = UpdateStats()
    tokens_seen = 0.0
    grad_scale = float(ctx.world)  # DDP averages gradients over ranks; the loss is already a global sum
    for iteration in range(g.num_iterations):
        for chunk in chunks:
            rows = [r for k in chunk for r in minibatches[k]]
            n_tokens = float(mask[rows].sum())
            n_seq = float(len(rows)) if scorable is None else float(scorable[rows].sum())
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
                sub, sub_mask = rollout.select(mb), mask[mb]
                with no_sync(module, skip=ctx.active and not last):
                    logp, logits = policy.logprobs(sub, g.temperature, return_logits=iteration == 0, module=module)
                    out = policy_loss(logp, old_logp[mb] if old_logp is not None else logp.detach(), advantages[mb],
                                      sub_mask, loss_type=g.loss_type, epsilon_low=g.epsilon, epsilon_high=eps_high,
                                      importance_sampling_level=g.importance_sampling_level,
                                      ref_logp=None if ref_logp is None else ref_logp[mb], beta=g.kl_beta,
                                      kl_estimator=g.kl_estimator, max_completion_length=g.max_completion_length,
                                      num_sequences=n_seq,
                                      num_tokens=float(sub_mask.sum()) if g.loss_type == "bnpo" else n_tokens)
                    loss = out.loss * share
                    (loss * grad_scale if ctx.active else loss).backward()
                if iteration == 0:
                    weight = float(sub_mask.sum())
                    stats.entropy += float(masked_entropy(logits.detach(), sub_mask)) * weight
                    stats.logprob_mean += float((logp.detach() * sub_mask).sum())
                    tokens_seen += weight
                chunk_loss = chunk_loss + loss.detach()
                stats.pg_loss += float(out.pg_loss) * share
                stats.kl += float(out.kl) * share
                stats.clip_low_frac += float(out.clip_low_frac) * len(mb) / n
                stats.clip_high_frac += float(out.clip_high_frac) * len(mb) / n
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
                continue
            optimizer.step()
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


def _atomic_save_final(policy: Policy, out: Path, provenance: dict[str, Any]) -> None:
    """models/grpo: the full model, or with LoRA the adapter alone (MBs, not a second copy of the base),
    its base named in provenance.json so every later stage loads base + adapter."""
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    save_model(policy.model, policy.tokenizer, tmp, extra=provenance)
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)


def train_grpo(cfg: PipelineConfig, paths: Paths = Paths(), callbacks: Sequence[StepCallback] = ()) -> dict[str, Any]:
    """Run GRPO from the SFT (or base) checkpoint; write models/grpo and the step metrics.

    `callbacks(step, policy, metrics)` run after each step (extra evaluation, logging); the rollout
    sampler has its own generator, so whatever they do with global RNGs never shifts training.

    With `distributed.nproc > 1` it re-launches itself under torchrun; under torchrun each rank
    samples its share of the prompt groups, trains through DDP, and only rank 0 logs and writes.
    """
    if needs_launch(cfg.distributed):
        launch("components.stages.grpo", cfg, paths.root)
        return json.loads((paths.metrics / "grpo.json").read_text())
    ctx = init(cfg.distributed, pick_device(cfg.device))
    try:
        return _train_grpo(cfg, paths, callbacks, ctx)
    finally:
        shutdown(ctx)


def _train_grpo(cfg: PipelineConfig, paths: Paths, callbacks: Sequence[StepCallback], ctx: DistContext
                ) -> dict[str, Any]:
    g = cfg.grpo
    seed_everything(cfg.seed, cfg.threads)
    device = ctx.device
    per_group = ctx.active or cfg.distributed.per_group_sampling
    say = print if ctx.is_main else (lambda *args, **kwargs: None)
    for warning in config_warnings(cfg):
        say(f"grpo: warning: {warning}", flush=True)
    start_dir = resolve_model_dir(paths.sft_model)
    if ctx.lockstep and callbacks:  # they run on rank 0 only: a forward there would wait for the others forever
        raise ConfigError("grpo: step callbacks are not supported with distributed.strategy fsdp2 (sharded model)")
    if ctx.lockstep and g.prompts_per_step % ctx.world:
        raise ConfigError(f"grpo.prompts_per_step ({g.prompts_per_step}) must be divisible by the {ctx.world} "
                          "processes with distributed.strategy fsdp2 (lockstep sampling)")
    # fsdp2: load whole on the CPU; fully_shard moves each rank's shards to its device.
    records = read_jsonl(split_path(paths.data, "train"))
    policy = build_policy(cfg, start_dir, torch.device("cpu") if ctx.lockstep else device, records)
    rewards = RewardModel(reward_specs(g), timeout_s=g.reward_timeout_s)
    schedule = PromptSchedule(len(records), g.prompts_per_step, cfg.seed)
    rollout_gen = torch.Generator(device=device).manual_seed(cfg.seed + 1)
    moving_reference = policy.reference is not None and g.reference.mode != "static"

    # Everything DVC re-runs this stage for (its params, data and starting model) keys the checkpoints.
    run_hash = stage_params_hash(cfg, "grpo", dir_md5(start_dir), file_md5(split_path(paths.data, "train")))
    if ctx.is_main:
        for stale in discard_foreign(paths.grpo_checkpoints, run_hash):
            print(f"grpo: removed checkpoint {stale} (trained from other inputs)")
        # A DVC output even when the run is shorter than checkpoint_every (or checkpointing is off).
        paths.grpo_checkpoints.mkdir(parents=True, exist_ok=True)
    barrier(ctx)
    start_step, history = 0, []
    resume_from = latest_checkpoint(paths.grpo_checkpoints, run_hash)
    held = None
    if ctx.lockstep:  # resume into the whole model, then shard it; the optimizer state follows once built
        from components.engine.fsdp import HeldOptimizerState, load_optimizer_state, shard_model

        if resume_from is not None:
            held = HeldOptimizerState()
            state = load_checkpoint(resume_from, policy.model, held, policy.reference if moving_reference else None)
        shard_model(policy.model, ctx)
        if policy.reference is not None:
            shard_model(policy.reference, ctx)
    trainable = [p for p in policy.model.parameters() if p.requires_grad]
    # The fused kernel updates every tensor in one pass (a per-tensor loop costs ~2 ms a step on the tiny model).
    fused = device.type in ("cpu", "cuda") and all(p.is_floating_point() for p in trainable)
    optimizer = torch.optim.AdamW(trainable, lr=g.learning_rate, weight_decay=g.weight_decay, fused=fused or None)
    if held is not None:
        load_optimizer_state(policy.model, optimizer, held.state)
    elif resume_from is not None:
        state = load_checkpoint(resume_from, policy.model, optimizer, policy.reference if moving_reference else None)
    if resume_from is not None:
        start_step, history = int(state["step"]), list(state["history"])
        rollout_gen.set_state(state["rollout_rng"])
        torch.set_rng_state(state["torch_rng"])
        say(f"grpo: resumed from {resume_from} at step {start_step}/{g.steps}")
    last_checkpoint = start_step if resume_from is not None else 0
    if per_group:
        # DDP and FSDP need every forward through their wrapper, and per-group sampling promises the
        # same result for any number of processes: both use the plain forward, not the prompt-once one.
        policy.fast = policy.fast_reference = None
    if ctx.lockstep:
        say(f"grpo: {ctx.world} processes (FSDP2, {'nccl' if device.type == 'cuda' else 'gloo'}): weights, "
            f"gradients and optimizer state sharded; {g.prompts_per_step} prompts per step shared between them")
    elif ctx.active:
        policy.trainer = wrap_ddp(policy.model, ctx)
        say(f"grpo: {ctx.world} processes (DDP, {'nccl' if device.type == 'cuda' else 'gloo'}), "
            f"{g.prompts_per_step} prompts per step shared between them")

    bad_steps = reward_failures = 0
    window: list[dict[str, float]] = []  # this MLflow point's steps (grpo.metrics_every)
    with tracking_run(ctx, cfg.tracking.experiment, "grpo", to_flat_dict(cfg)) as run:
        run.set_tags({"grpo.resumed_from_step": start_step})
        reporter = GRPOReporter(run, policy.tokenizer, g.group_size, cfg.reports)
        started = time.perf_counter()
        for step in range(start_step, g.steps):
            set_progress(f"at step {step + 1} of {g.steps}; "
                         + (f"the last checkpoint is step {last_checkpoint}" if last_checkpoint else "no checkpoint yet"))
            t_step = time.perf_counter()
            lr = learning_rate(step, g)
            for group in optimizer.param_groups:
                group["lr"] = lr

            t0 = time.perf_counter()
            try:
                if per_group:
                    from components.engine.sharded_sampling import collect_batch_sharded

                    t_scoring = 0.0  # per-group sampling scores inside its loop: counted as generation
                    rollout, totals, first_scores, sampled = collect_batch_sharded(policy, records, schedule, step, g,
                                                                                   rewards, cfg.seed, ctx)
                else:
                    rollout, totals, first_scores, sampled, t_scoring = collect_batch(policy, records, schedule, step,
                                                                                      g, rewards, rollout_gen)
            except RewardError as err:
                reward_failures += 1
                run.log_metrics({"rollout/reward_failures": reward_failures}, step=step + 1)
                say(f"grpo: step {step + 1} skipped: {err} ({reward_failures} in a row)", flush=True)
                if reward_failures > g.max_reward_failures:
                    raise StageFailed(f"grpo: rewards failed on {reward_failures} steps in a row "
                                      f"(grpo.max_reward_failures = {g.max_reward_failures}); last error: {err}") from err
                continue
            reward_failures = 0
            t_gen = time.perf_counter() - t0 - t_scoring

            t0 = time.perf_counter()
            reward_t = torch.tensor(totals, dtype=torch.float32, device=device)
            scorable = ~torch.isnan(reward_t)  # unscored completions: advantage 0 and out of the loss
            if g.algorithm == "reinforce":
                advantages = torch.nan_to_num(reward_t, nan=0.0)  # absolute reward, no baseline
            elif len(reward_t):
                advantages = group_advantages(reward_t, g.group_size, g.scale_rewards)
            else:
                advantages = reward_t
            mask = loss_mask(rollout, scorable, g.mask_truncated_completions)
            t_reward = time.perf_counter() - t0 + t_scoring

            t0 = time.perf_counter()
            ref_logp = None
            if g.kl_beta > 0 and len(rollout) and ctx.active:  # only the rows this rank trains on
                mine = sorted({r for mb in minibatch_plan(len(rollout), g) for r in local_rows(mb, g.group_size, ctx)})
                ref_logp = torch.zeros(rollout.completion_ids.shape, dtype=torch.float32, device=device)
                if mine or ctx.lockstep:  # fsdp2: a rank without rows still joins the forward
                    part = policy.reference_logprobs(rollout.select(mine or [0]), g.temperature)
                    if mine:
                        ref_logp[mine] = part
            elif g.kl_beta > 0 and len(rollout):
                ref_logp = policy.reference_logprobs(rollout, g.temperature)
            t_ref = time.perf_counter() - t0

            t0 = time.perf_counter()
            stats = policy_updates(policy, optimizer, rollout, advantages, mask, ref_logp, g, ctx, scorable) \
                if len(rollout) else UpdateStats()
            t_policy = time.perf_counter() - t0
            if stats.skipped_updates:
                bad_steps += 1
                say(f"grpo: step {step + 1}: non-finite loss or gradient, {stats.skipped_updates} update(s) "
                      f"skipped ({bad_steps} step(s) in a row)")
                if bad_steps > MAX_BAD_STEPS:
                    raise StageFailed(f"grpo: more than {MAX_BAD_STEPS} consecutive steps with non-finite loss or "
                                      f"gradients (last at step {step + 1}); last good checkpoint kept in "
                                      f"{paths.grpo_checkpoints}")
            else:
                bad_steps = 0
            if moving_reference:
                update_reference(policy.reference, policy.model, g.reference.mode, step, g.reference.ema_alpha,
                                 g.reference.sync_every)

            step_seconds = time.perf_counter() - t_step
            first_t = torch.tensor(first_scores.total)
            grouped = first_t.view(-1, g.group_size)
            metrics = {
                "loss": stats.loss, "pg_loss": stats.pg_loss, "kl": stats.kl,
                "reward_mean": float(first_t.mean()), "reward_std": float(first_t.std()) if len(first_t) > 1 else 0.0,
                "advantage_mean": float(advantages.mean()) if len(advantages) else 0.0,
                "logprob_mean": stats.logprob_mean, "entropy": stats.entropy,
                "completion_length": float(rollout.completion_mask.sum(-1).float().mean()) if len(rollout) else 0.0,
                "truncated_frac": float(rollout.truncated.float().mean()) if len(rollout) else 0.0,
                "zero_std_group_frac": float((grouped.max(1).values == grouped.min(1).values).float().mean()),
                "kept_completions": float(len(rollout)), "sampled_completions": float(sampled),
                "unscored_completions": float((~scorable).sum()),
                "grad_norm": stats.grad_norm, "learning_rate": lr, "clip_low_frac": stats.clip_low_frac,
                "clip_high_frac": stats.clip_high_frac, "step_seconds": step_seconds,
                "completions_per_s": sampled / step_seconds, "time/generation": t_gen,
                "time/reward": t_reward, "time/reference": t_ref, "time/policy": t_policy,
            }
            metrics.update({f"reward/{k}/mean": v for k, v in first_scores.component_means().items()})
            history.append({"step": step + 1, **{k: round(v, 6) for k, v in metrics.items()}})
            window.append(metrics)
            if (step + 1) % g.metrics_every == 0:
                run.log_metrics(mlflow_metric_names(window_mean(window)), step=step + 1)
                window = []
            for callback in callbacks if ctx.is_main else ():
                callback(step + 1, policy.model, metrics)
            if ctx.is_main:
                reporter.on_step(step + 1, rollout, first_scores, advantages, final=step + 1 == g.steps)
            if ctx.is_main and ((step + 1) % g.log_every == 0 or step + 1 == g.steps):
                done = step + 1 - start_step
                rate = done / (time.perf_counter() - started)
                eta = (g.steps - step - 1) / rate if rate > 0 else float("inf")
                recent = history[-g.log_every:]
                mean_reward = sum(h["reward_mean"] for h in recent) / len(recent)
                print(f"grpo: step {step + 1}/{g.steps} reward {mean_reward:.3f} kl {metrics['kl']:.4f} "
                      f"loss {metrics['loss']:+.4f} | {rate:.2f} steps/s, {metrics['completions_per_s']:.0f} "
                      f"completions/s, ETA {eta:.0f}s", flush=True)
            checkpoint_due = g.checkpoint_every and (step + 1) % g.checkpoint_every == 0 and step + 1 < g.steps
            if checkpoint_due and bad_steps == 0:  # never inside a non-finite streak
                saved = {"step": step + 1, "rollout_rng": rollout_gen.get_state(),
                         "history": [{k: v for k, v in h.items() if k not in TIMING_KEYS} for h in history],
                         "torch_rng": torch.get_rng_state()}
                if ctx.lockstep:  # every rank gathers its shards; rank 0 writes the usual format
                    from components.engine.fsdp import save_sharded_checkpoint

                    save_sharded_checkpoint(paths.grpo_checkpoints, step + 1, run_hash, policy.model, optimizer,
                                            saved, policy.reference if moving_reference else None,
                                            lambda: load_policy_model(cfg, start_dir, torch.device("cpu")), ctx)
                elif ctx.is_main:
                    save_checkpoint(paths.grpo_checkpoints, step + 1, run_hash, policy.model, optimizer, saved,
                                    policy.reference if moving_reference else None)
                last_checkpoint = step + 1

        if window:  # the last, partial window (also when the last steps were skipped)
            run.log_metrics(mlflow_metric_names(window_mean(window)), step=history[-1]["step"])
        if ctx.lockstep:  # the final model, gathered whole, saved by rank 0 as a normal HF directory
            from components.engine.fsdp import full_model_state, plain_copy

            weights = full_model_state(policy.model)
            if ctx.is_main:
                policy = dataclasses.replace(policy, model=plain_copy(
                    lambda: load_policy_model(cfg, start_dir, torch.device("cpu")), weights), reference=None)
        if not ctx.is_main:
            return {}
        _atomic_save_final(policy, paths.grpo_model, {"stage": "grpo", "run_hash": run_hash, "steps": g.steps,
                                                      "start": str(start_dir),
                                                      **({"base_model": str(start_dir)} if policy.lora else {})})
        summary = write_step_outputs(history, paths)
        reporter.finish(history, paths.plots)
    return summary


# MLflow's run page shows one section of charts per prefix before "/", sections in alphabetical order
# (unprefixed charts last): the charts that say whether training works come first as `learning/`, then
# optim/, reward/<name>/, rollout/, time/ (plots/grpo_steps.csv keeps the plain names).
METRIC_GROUPS = {
    "learning": ("reward_mean", "reward_std", "kl", "entropy", "completion_length"),
    "optim": ("loss", "pg_loss", "advantage_mean", "logprob_mean", "grad_norm", "learning_rate", "clip_low_frac",
              "clip_high_frac"),
    "rollout": ("truncated_frac", "zero_std_group_frac", "kept_completions", "sampled_completions",
                "unscored_completions", "reward_failures"),
    "time": ("step_seconds", "completions_per_s"),
}
_GROUP_OF = {key: group for group, keys in METRIC_GROUPS.items() for key in keys}


def mlflow_metric_names(metrics: dict[str, float]) -> dict[str, float]:
    """`grad_norm` -> `optim/grad_norm`, `kl` -> `learning/kl`; `time/...` and `reward/...` as they are."""
    return {(f"{_GROUP_OF[k]}/{k}" if k in _GROUP_OF else k): v for k, v in metrics.items()}


def window_mean(rows: list[dict[str, float]]) -> dict[str, float]:
    """Each metric's mean over the steps that have it: one MLflow point per window, not per step."""
    keys = dict.fromkeys(k for row in rows for k in row)
    return {k: sum(row[k] for row in rows if k in row) / sum(1 for row in rows if k in row) for k in keys}


def write_step_outputs(history: list[dict[str, Any]], paths: Paths) -> dict[str, Any]:
    """Per-step CSV (DVC plots) and a small summary JSON (DVC metrics)."""
    paths.plots.mkdir(parents=True, exist_ok=True)
    paths.metrics.mkdir(parents=True, exist_ok=True)
    keys = list(history[-1].keys()) if history else ["step"]  # the last row has every column, timings included
    with (paths.plots / "grpo_steps.csv").open("w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=keys, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(history)
    tail = history[-max(1, len(history) // 10):]
    summary = {"steps": len(history),
               "reward_mean_first10pct": _mean(history[: max(1, len(history) // 10)], "reward_mean"),
               "reward_mean_last10pct": _mean(tail, "reward_mean"), "kl_last": history[-1]["kl"] if history else 0.0}
    (paths.metrics / "grpo.json").write_text(json.dumps(summary, indent=2, sort_keys=True) + "\n")
    return summary


def _mean(rows: list[dict[str, Any]], key: str) -> float:
    return round(sum(r[key] for r in rows) / len(rows), 6) if rows else 0.0


def main(argv: list[str] | None = None) -> int:
    return stage_main("GRPO training.", train_grpo, argv)


if __name__ == "__main__":
    sys.exit(main())
