"""Stage `grpo`: Group Relative Policy Optimization, readable top to bottom.

Each step: sample G completions for each of the step's prompts through the policy's engine and score them (DAPO:
keep the informative groups) -> the reference's log-probs (only with a KL term) -> the step's trajectory (advantages,
the tokens the loss sees) -> `num_iterations` passes of updates -> move the reference (ema/periodic) -> log ->
checkpoint. Everything the loop uses is built once before it (components/engine/grpo/training.py: the loss from
config, the policy and its rollout engine, the optimizer, resume); the pieces live in components/engine/grpo/.
Resumes from the newest checkpoint trained from the same inputs; on CPU with a fixed seed a resumed run ends with
the same weights.
"""

from __future__ import annotations

import functools
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import psutil
import torch

from components.config import ConfigError, PipelineConfig, config_warnings, stage_params_hash, to_flat_dict
from components.data.checkpoints import best_meta, latest_checkpoint, newest_step, set_aside_other_inputs
from components.data.paths import Paths
from components.data.records import dir_md5, file_md5, read_jsonl, split_path
from components.engine.evaluation.heldout import HeldoutProbe
from components.engine.evaluation.monitors import Monitors, for_dtype
from components.engine.grpo.batch import collect_batch
from components.engine.grpo.memory_estimate import GiB
from components.engine.grpo.policy import update_reference
from components.engine.grpo.train_state import save_kept_model, save_training_state
from components.engine.grpo.training import Training, prepare_training
from components.engine.grpo.trajectory import build_trajectory
from components.engine.grpo.update import UpdatePlan, UpdateStats, old_logprobs, policy_updates, reference_logprobs
from components.engine.models.modeling import load_policy_model, pick_device, resolve_model_dir, seed_everything
from components.engine.models.optim import cosine_learning_rate, set_learning_rate
from components.engine.parallel.distributed import DistContext, barrier, init, launch, needs_launch, shutdown
from components.engine.rewards.rewards import RewardError
from components.errors import StageFailed
from components.interruptions import set_progress
from components.run_marker import NoMarker, RunMarker, killed_run_text
from components.stages.cli import stage_main
from components.stages.grpo_steps import (
    HeldoutDuringTraining,
    StepCallback,
    StepWatch,
    checkpoint_due,
    phase_seconds,
    report_run,
    step_metrics,
)
from components.tracking.reports import GRPOReporter
from components.tracking.runs import tracking_run
from components.tracking.step_log import StepLog

MAX_BAD_STEPS = 3


def train_grpo(cfg: PipelineConfig, paths: Paths = Paths(), callbacks: Sequence[StepCallback] = ()) -> dict[str, Any]:
    """Run GRPO from the SFT (or base) checkpoint; write models/grpo and the step metrics.

    `callbacks(step, policy, metrics)` run after each step (extra evaluation, logging); the rollout
    sampler has its own generator, so whatever they do with global RNGs never shifts training.

    With `distributed.nproc > 1` it re-launches itself under torchrun; under torchrun each rank
    samples its share of the prompt groups, trains through DDP (or FSDP2), and only rank 0 logs and writes.
    """
    if needs_launch(cfg.distributed):
        launch("components.stages.grpo", cfg, paths.root)
        return json.loads((paths.metrics / "grpo.json").read_text())
    ctx = init(cfg.distributed, pick_device(cfg.device))
    marker = RunMarker(paths.grpo_checkpoints.parent / "grpo.running.json") if ctx.is_main else NoMarker()
    try:
        if note := marker.left_by_a_killed_run():
            print(killed_run_text("grpo", note), flush=True)
        return _train_grpo(cfg, paths, callbacks, ctx, marker)
    except (MemoryError, RuntimeError) as err:  # torch.OutOfMemoryError is a RuntimeError
        if not is_out_of_memory(err):
            raise
        raise StageFailed(out_of_memory_text(err, marker.fields)) from err
    finally:
        marker.clear()
        shutdown(ctx)


def is_out_of_memory(err: BaseException) -> bool:
    """An allocation the machine could not serve (CPU allocator, CUDA, or Python itself)."""
    return isinstance(err, (MemoryError, torch.OutOfMemoryError)) or "can't allocate memory" in str(err)


def out_of_memory_text(err: BaseException, note: dict[str, Any]) -> str:
    where = f"at step {note['step'] + 1} of {note['steps']}" if "step" in note else "before the first step"
    estimate = (f"; a step was estimated at {note['estimate_gb']:.1f} GB with {note['available_gb']:.1f} GB free"
                if "estimate_gb" in note else "")
    lower = f"; lower it with {note['knobs']}" if note.get("knobs") else ""
    return (f"out of memory {where} ({type(err).__name__}: {str(err).splitlines()[0][:160]}){estimate}{lower}; "
            "the checkpoints are kept: rerun to resume")


def _train_grpo(cfg: PipelineConfig, paths: Paths, callbacks: Sequence[StepCallback], ctx: DistContext,
                marker: RunMarker) -> dict[str, Any]:
    # ---- set-up: data, then everything the loop uses (engine/grpo/training.py), resumed where a run stopped
    g, say = cfg.grpo, (print if ctx.is_main else (lambda *args, **kwargs: None))
    _check_settings(cfg, ctx, callbacks, say)
    seed_everything(cfg.seed, cfg.threads)
    start_dir = resolve_model_dir(paths.sft_model)
    records = read_jsonl(split_path(paths.data, "train"))
    # Everything DVC re-runs this stage for (its params, data and starting model) keys the checkpoints.
    run_hash = stage_params_hash(cfg, "grpo", dir_md5(start_dir), file_md5(split_path(paths.data, "train")))
    t = prepare_training(cfg, start_dir, records, ctx, _checkpoint_to_resume(paths, run_hash, ctx), say)
    policy, loss, optimizer, history = t.policy, t.loss, t.optimizer, t.history
    marker.write(steps=g.steps, estimate_gb=t.memory.memory.peak / GiB,
                 available_gb=psutil.virtual_memory().available / GiB, knobs=t.memory.knobs)
    load_plain = lambda: load_policy_model(cfg, start_dir, torch.device("cpu"))  # noqa: E731 - fsdp2 gathers
    last_checkpoint, bad_steps, reward_failures = t.start_step, 0, 0
    probe, monitors = _probe_and_monitors(cfg, paths, t, ctx, say)

    with tracking_run(ctx.is_main, cfg.tracking.experiment, "grpo", to_flat_dict(cfg)) as run:
        run.set_tags({"grpo.resumed_from_step": t.start_step})
        reporter = GRPOReporter(run, policy.tokenizer, cfg.reports, lambda r: policy.generation.read(r).transcripts)
        log = StepLog(run, g, t.start_step, history, ctx.is_main, cfg.monitors.not_learning,
                      cfg.tracking.metrics_flush_s)
        heldout = HeldoutDuringTraining(probe, cfg, paths, run, run_hash,
                                        best_meta(paths.grpo_checkpoints, run_hash) if g.keep == "best" else None, say)
        watch = StepWatch(cfg, run, log, history, monitors, reporter, callbacks, ctx.is_main, say)
        heldout.evaluate_start(policy, start_dir, t.start_step, ctx)  # the held-out curve's step 0
        for step in range(t.start_step, g.steps):
            set_progress(functools.partial(_where, step + 1, g.steps, paths.grpo_checkpoints))
            t_step = time.perf_counter()
            set_learning_rate(optimizer, cosine_learning_rate(step, g.steps, g.learning_rate, g.warmup_steps,
                                                              g.min_lr_ratio))
            # 1. sample G completions per prompt and score them
            try:
                batch = collect_batch(t.sample_round, t.schedule, step, g, t.pad_id)
            except RewardError as err:
                reward_failures = _reward_failure(err, step, reward_failures, g.max_reward_failures, run, say)
                continue
            reward_failures, t_sampled, rollouts = 0, time.perf_counter(), batch.rollouts
            plan = UpdatePlan.of(len(rollouts), rollouts.group_size, g, ctx)
            # 2. the reference's log-probs, once per step, only when the loss has a KL term
            ref_logp = reference_logprobs(policy, rollouts, plan, ctx) \
                if loss.uses_reference and len(rollouts) else None
            t_reference = time.perf_counter()
            # 3. the step's trajectory: advantages (a completion no reward scored: 0, and out of the loss) and,
            #    when the weights move within the step, the sampling weights' log-probs
            old_logp = old_logprobs(policy, rollouts, plan, ctx) \
                if plan.needs_old_logprobs and len(rollouts) else None
            trajectory = build_trajectory(rollouts, batch.advantage_rewards, loss, g.mask_truncated_completions,
                                          ref_logp, old_logp)
            # 4. the policy update
            stats = policy_updates(policy, optimizer, trajectory, g, loss, plan, ctx) if len(trajectory) \
                else UpdateStats()
            t_policy = time.perf_counter()
            bad_steps = _count_bad_steps(stats, step, bad_steps, paths, say)
            # 5. move the reference (ema / periodic)
            if t.moving_reference:
                update_reference(policy.reference, policy.model, g.reference.mode, step, g.reference.ema_alpha,
                                 g.reference.sync_every)
            # 6. log: the step's metrics, held-out ones when due, then everything that watches a step
            metrics = step_metrics(batch, stats, trajectory, optimizer.param_groups[0]["lr"], phase_seconds(
                t_step, t_sampled, t_reference, t_policy, time.perf_counter(), batch.reward_seconds))
            heldout(step + 1, metrics, policy)
            watch(step + 1, metrics, batch, trajectory, policy.model)
            # 7. checkpoint (never inside a non-finite streak)
            if checkpoint_due(step + 1, g) and not bad_steps:
                save_training_state(paths.grpo_checkpoints, step + 1, run_hash, policy, optimizer, t.moving_reference,
                                    history, t.rollout_gen, ctx, load_plain)
                last_checkpoint = step + 1
            if (step + 1) % g.log_every == 0 or last_checkpoint == step + 1:
                marker.write(step=step + 1, last_checkpoint=last_checkpoint)

        log.flush()
        # ---- finish: the kept weights become models/grpo; the run's summary, verdict and reports
        kept = save_kept_model(policy, paths, history, heldout.best, run_hash, start_dir, g, ctx, load_plain, say)
        if not ctx.is_main:
            return {}
        return report_run(cfg, paths, run, kept, history, probe, monitors, log, heldout, reporter, say)


# ---- the details the loop above hides: settings a run refuses, resume, failure streaks

def _where(step: int, steps: int, checkpoints: Path) -> str:
    """`at step 12 of 40; the last checkpoint is step 10`, read when a stop is reported: the checkpoint named is the
    newest on disk then, the one a rerun resumes from, also when the stop came just after it was written."""
    last = newest_step(checkpoints)
    return f"at step {step} of {steps}; " + (f"the last checkpoint is step {last}" if last else "no checkpoint yet")


def _probe_and_monitors(cfg: PipelineConfig, paths: Paths, t: Training, ctx: DistContext,
                        say) -> tuple[HeldoutProbe | None, Monitors]:
    """Held-out evaluation during training (rank 0; not with a sharded model) and the monitors reading it, replayed
    over a resumed run's history."""
    policy = t.policy
    probe = HeldoutProbe(cfg, paths, policy.tokenizer) if ctx.is_main and not ctx.lockstep and cfg.evaluate.every \
        else None
    checks, unchecked = for_dtype(cfg.monitors, next(policy.model.parameters()).dtype)
    if unchecked:
        say(f"grpo: {unchecked}")
    monitors = Monitors(checks, cfg.grpo.keep_metric, cfg.grpo.steps)
    monitors.replay(t.history)
    return probe, monitors


def _check_settings(cfg: PipelineConfig, ctx: DistContext, callbacks: Sequence[StepCallback], say) -> None:
    """Print the config's warnings; refuse what a sharded (fsdp2) run cannot do."""
    for warning in config_warnings(cfg):
        say(f"grpo: warning: {warning}", flush=True)
    if ctx.lockstep and callbacks:  # they run on rank 0 only: a forward there would wait for the others forever
        raise ConfigError("grpo: step callbacks are not supported with distributed.strategy fsdp2 (sharded model)")
    if ctx.lockstep and cfg.grpo.prompts_per_step % ctx.world:
        raise ConfigError(f"grpo.prompts_per_step ({cfg.grpo.prompts_per_step}) must be divisible by the "
                          f"{ctx.world} processes with distributed.strategy fsdp2 (lockstep sampling)")


def _checkpoint_to_resume(paths: Paths, run_hash: str, ctx: DistContext) -> Path | None:
    """Set aside checkpoints trained from other inputs, drop half-written and damaged ones (rank 0, each said),
    then the newest intact one of this run, if any."""
    found = None
    if ctx.is_main:
        set_aside_other_inputs(paths.grpo_checkpoints, run_hash)
        paths.grpo_checkpoints.mkdir(parents=True, exist_ok=True)
        skipped: list[str] = []
        found = latest_checkpoint(paths.grpo_checkpoints, run_hash, lambda line: (print(line), skipped.append(line)),
                                  remove_damaged=True)
        if found is None and skipped:
            print("grpo: no intact checkpoint of this run is left: starting from step 0")
    barrier(ctx)
    return found if ctx.is_main else latest_checkpoint(paths.grpo_checkpoints, run_hash, lambda *_: None)


def _reward_failure(err: RewardError, step: int, failures: int, allowed: int, run, say) -> int:
    """Skip the step; stop the stage after more than `allowed` failed steps in a row."""
    failures += 1
    run.log_metrics({"rollout/reward_failures": failures}, step=step + 1)
    say(f"grpo: step {step + 1} skipped: {err} ({failures} in a row)", flush=True)
    if failures > allowed:
        raise StageFailed(f"grpo: rewards failed on {failures} steps in a row "
                          f"(grpo.max_reward_failures = {allowed}); last error: {err}") from err
    return failures


def _count_bad_steps(stats: UpdateStats, step: int, bad_steps: int, paths: Paths, say) -> int:
    """Consecutive steps with a skipped (non-finite) update; more than MAX_BAD_STEPS stops the stage."""
    if not stats.skipped_updates:
        return 0
    bad_steps += 1
    say(f"grpo: step {step + 1}: non-finite loss or gradient, {stats.skipped_updates} update(s) "
        f"skipped ({bad_steps} step(s) in a row)")
    if bad_steps > MAX_BAD_STEPS:
        raise StageFailed(f"grpo: more than {MAX_BAD_STEPS} consecutive steps with non-finite loss or "
                          f"gradients (last at step {step + 1}); last good checkpoint kept in {paths.grpo_checkpoints}")
    return bad_steps


def main(argv: list[str] | None = None) -> int:
    return stage_main("GRPO training.", train_grpo, argv)


if __name__ == "__main__":
    sys.exit(main())
