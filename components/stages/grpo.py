"""Stage `grpo`: Group Relative Policy Optimization, readable top to bottom.

Each step: sample G completions for each of the step's prompts and score them (DAPO: keep the
informative groups) -> group-relative advantages -> reference log-probs (only with a KL term) ->
`num_iterations` passes of clipped-surrogate updates -> move the reference (ema/periodic) -> log ->
checkpoint. The pieces live in components/engine/ (sampling, objectives, update, policy, train_state);
the loss is built once from config. Resumes from the newest checkpoint trained from the same inputs;
on CPU with a fixed seed a resumed run ends with the same weights.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, Sequence

import psutil
import torch

from components.config import ConfigError, PipelineConfig, config_warnings, stage_params_hash, to_flat_dict
from components.data.checkpoints import BEST, best_meta, latest_checkpoint, load_weights, set_aside_other_inputs
from components.data.paths import Paths
from components.data.records import dir_md5, file_md5, read_jsonl, split_path
from components.engine.evaluation.heldout import HeldoutProbe
from components.engine.evaluation.monitors import Monitors, for_dtype, generalisation, generalisation_text
from components.engine.grpo.host_memory import configure_allocator
from components.engine.grpo.memory_estimate import GiB, ModelShape, StepMemory, estimate_step_memory, knobs
from components.engine.grpo.objectives import build_loss
from components.engine.grpo.policy import Policy, build_policy, longest_row, update_reference
from components.engine.grpo.sampling import PromptSchedule, collect_batch, collect_batch_sharded, reward_specs
from components.engine.grpo.train_state import optimizer_and_resume, save_final_model, save_training_state
from components.engine.grpo.trajectory import scored_trajectory
from components.engine.grpo.update import UpdateStats, policy_updates, reference_logprobs
from components.engine.models.modeling import load_policy_model, pick_device, resolve_model_dir, seed_everything
from components.engine.models.optim import cosine_learning_rate, set_learning_rate
from components.engine.parallel.distributed import DistContext, barrier, init, launch, needs_launch, shutdown, wrap_ddp
from components.engine.rewards.rewards import RewardError, RewardModel
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
    step_metrics,
)
from components.tracking.reports import GRPOReporter
from components.tracking.runs import tracking_run
from components.tracking.step_log import StepLog, write_step_outputs

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
    # ---- setup: data, loss (built once), policy (+ reference only if the loss has a KL term), resume
    g, say = cfg.grpo, (print if ctx.is_main else (lambda *args, **kwargs: None))
    _check_settings(cfg, ctx, callbacks, say)
    seed_everything(cfg.seed, cfg.threads)
    start_dir = resolve_model_dir(paths.sft_model)
    records = read_jsonl(split_path(paths.data, "train"))
    loss = build_loss(g)
    per_group = ctx.active or cfg.distributed.per_group_sampling  # several processes: every forward the wrapper's
    policy = build_policy(cfg, start_dir, torch.device("cpu") if ctx.lockstep else ctx.device, records,
                          with_reference=loss.uses_reference, fast=not per_group, say=say)
    moving_reference = policy.reference is not None and g.reference.mode != "static"
    memory = fit_memory(cfg, policy, records, say)
    marker.write(steps=g.steps, estimate_gb=memory.peak / GiB, available_gb=psutil.virtual_memory().available / GiB,
                 knobs=knobs(replace(g, gradient_checkpointing="always" if policy.gradient_checkpointing else "never")))
    rewards = RewardModel(reward_specs(g), timeout_s=g.reward_timeout_s)
    schedule = PromptSchedule(len(records), g.prompts_per_step, cfg.seed)
    rollout_gen = torch.Generator(device=ctx.device).manual_seed(cfg.seed + 1)
    # Everything DVC re-runs this stage for (its params, data and starting model) keys the checkpoints.
    run_hash = stage_params_hash(cfg, "grpo", dir_md5(start_dir), file_md5(split_path(paths.data, "train")))
    resume_from = _checkpoint_to_resume(paths, run_hash, ctx)
    optimizer, state = optimizer_and_resume(policy, g, ctx, resume_from, moving_reference)
    start_step, history = (int(state["step"]), list(state["history"])) if state else (0, [])
    if state:
        rollout_gen.set_state(state["rollout_rng"])
        torch.set_rng_state(state["torch_rng"])
        say(f"grpo: resumed from {resume_from} at step {start_step}/{g.steps}")
    _distribute(policy, cfg, ctx, say)
    load_plain = lambda: load_policy_model(cfg, start_dir, torch.device("cpu"))  # noqa: E731 - fsdp2 gathers
    last_checkpoint, bad_steps, reward_failures = start_step, 0, 0
    # Held-out evaluation during training (rank 0; not with a sharded model) and the monitors reading it.
    probe = HeldoutProbe(cfg, paths, policy.tokenizer) if ctx.is_main and not ctx.lockstep and cfg.evaluate.every \
        else None
    checks, unchecked = for_dtype(cfg.monitors, next(policy.model.parameters()).dtype)
    if unchecked:
        say(f"grpo: {unchecked}")
    monitors = Monitors(checks, g.keep_metric, g.steps)
    monitors.replay(history)

    with tracking_run(ctx.is_main, cfg.tracking.experiment, "grpo", to_flat_dict(cfg)) as run:
        run.set_tags({"grpo.resumed_from_step": start_step})
        reporter = GRPOReporter(run, policy.tokenizer, g.group_size, cfg.reports)
        log = StepLog(run, g, start_step, history, ctx.is_main, cfg.monitors.not_learning,
                      cfg.tracking.metrics_flush_s)
        heldout = HeldoutDuringTraining(probe, cfg, paths, run, run_hash,
                                        best_meta(paths.grpo_checkpoints, run_hash) if g.keep == "best" else None, say)
        watch = StepWatch(cfg, run, log, history, monitors, reporter, callbacks, ctx.is_main, say)
        heldout.evaluate_start(policy, start_dir, start_step, ctx)  # the held-out curve's step 0
        for step in range(start_step, g.steps):
            set_progress(f"at step {step + 1} of {g.steps}; " + (f"the last checkpoint is step {last_checkpoint}"
                                                                 if last_checkpoint else "no checkpoint yet"))
            t_step = time.perf_counter()
            set_learning_rate(optimizer, cosine_learning_rate(step, g.steps, g.learning_rate, g.warmup_steps,
                                                              g.min_lr_ratio))
            # 1. sample G completions per prompt and score them
            try:
                batch = (collect_batch_sharded(policy, records, schedule, step, g, rewards, cfg.seed, ctx) if per_group
                         else collect_batch(policy, records, schedule, step, g, rewards, rollout_gen))
            except RewardError as err:
                reward_failures = _reward_failure(err, step, reward_failures, g.max_reward_failures, run, say)
                continue
            reward_failures, t_sampled = 0, time.perf_counter()
            # 2. advantages; completions no reward scored (NaN) get advantage 0 and stay out of the loss
            trajectory = scored_trajectory(batch.rollout, batch.totals, loss, g, ctx.device)
            t_advantages = time.perf_counter()
            # 3. reference log-probs, once per step, only when the loss has a KL term
            if loss.uses_reference and len(trajectory):
                trajectory.ref_logp = reference_logprobs(policy, batch.rollout, g, ctx)
            t_reference = time.perf_counter()
            # 4. the policy update
            stats = policy_updates(policy, optimizer, trajectory, g, ctx, loss) if len(trajectory) else UpdateStats()
            t_policy = time.perf_counter()
            bad_steps = _count_bad_steps(stats, step, bad_steps, paths, say)
            # 5. move the reference (ema / periodic)
            if moving_reference:
                update_reference(policy.reference, policy.model, g.reference.mode, step, g.reference.ema_alpha,
                                 g.reference.sync_every)
            # 6. log: the step's metrics, held-out ones when due, then everything that watches a step
            metrics = step_metrics(batch, stats, trajectory, optimizer.param_groups[0]["lr"], g, phase_seconds(
                t_step, t_sampled, t_advantages, t_reference, t_policy, time.perf_counter(), batch.reward_seconds))
            heldout(step + 1, metrics, policy)
            watch(step + 1, metrics, batch, trajectory, policy.model)
            # 7. checkpoint (never inside a non-finite streak)
            if checkpoint_due(step + 1, g) and not bad_steps:
                save_training_state(paths.grpo_checkpoints, step + 1, run_hash, policy, optimizer, moving_reference,
                                    history, rollout_gen, ctx, load_plain)
                last_checkpoint = step + 1
            if (step + 1) % g.log_every == 0 or last_checkpoint == step + 1:
                marker.write(step=step + 1, last_checkpoint=last_checkpoint)

        log.flush()
        kept = {"mode": g.keep, "step": g.steps, "metric": g.keep_metric,
                "value": history[-1].get(f"heldout/{g.keep_metric}") if history else None}
        best = heldout.best
        if best is not None and ctx.is_main:
            load_weights(paths.grpo_checkpoints / BEST, policy.model)
            kept.update(step=best["step"], value=best["value"])
            say(f"grpo: keeping the weights of step {best['step']} (held-out {g.keep_metric} {best['value']:.4f}, "
                f"the best of the evaluations during training) as {paths.grpo_model}")
        provenance = {"stage": "grpo", "run_hash": run_hash, "steps": g.steps, "start": str(start_dir),
                      "kept_step": kept["step"], **({"base_model": str(start_dir)} if policy.lora else {})}
        save_final_model(policy, paths.grpo_model, provenance, ctx, load_plain)
        if not ctx.is_main:
            return {}
        evaluations = [{"step": h["step"], **{k.removeprefix("heldout/"): v for k, v in h.items()
                                              if k.startswith("heldout/")}} for h in history
                       if any(k.startswith("heldout/") for k in h)]
        if probe is not None:
            evaluations.insert(0, {"step": 0, **{k: round(v, 6) for k, v in probe.origin_scores.items()}})
        run_verdict = generalisation(history, len(history), cfg.monitors.window, g.keep_metric, monitors.evals)
        if run_verdict:
            run_verdict["text"] = generalisation_text(run_verdict, _flat_threshold(cfg))
            say(f"grpo: over the run: {run_verdict['text']}", flush=True)
            run.set_tags({"grpo.generalisation": run_verdict["text"]})
        summary = write_step_outputs(history, paths, {
            "kept": kept, "monitors": monitors.summary(), "not_learning": log.warning,
            "heldout_evaluations": evaluations, "generalisation": run_verdict})
        if probe is not None:  # wall-clock: in MLflow, not in metrics/grpo.json (its hash must reproduce)
            run.log_metrics({"time/heldout_evaluation_total": probe.seconds}, step=g.steps)
        run.set_tags({"grpo.kept_step": kept["step"], "grpo.keep": g.keep})
        if heldout.model_ids.get(kept["step"]):
            run.set_model_tags(heldout.model_ids[kept["step"]], {"grpo.kept": f"models/grpo ({g.keep})"})
        reporter.finish(history, paths.plots)
    return summary


# ---- the details the loop above hides: the held-out start, the best checkpoint, multi-process set-up, resume,
# failure streaks

def _flat_threshold(cfg: PipelineConfig) -> float:
    """The training-reward rise that counts as learning: the `heldout_flat` check's, else not-learning's."""
    return next((c.above for c in cfg.monitors.checks if c.signal == "heldout_flat" and c.above is not None),
                cfg.monitors.not_learning.min_reward_gain)


def _check_settings(cfg: PipelineConfig, ctx: DistContext, callbacks: Sequence[StepCallback], say) -> None:
    """Print the config's warnings; refuse what a sharded (fsdp2) run cannot do."""
    for warning in config_warnings(cfg):
        say(f"grpo: warning: {warning}", flush=True)
    if ctx.lockstep and callbacks:  # they run on rank 0 only: a forward there would wait for the others forever
        raise ConfigError("grpo: step callbacks are not supported with distributed.strategy fsdp2 (sharded model)")
    if ctx.lockstep and cfg.grpo.prompts_per_step % ctx.world:
        raise ConfigError(f"grpo.prompts_per_step ({cfg.grpo.prompts_per_step}) must be divisible by the "
                          f"{ctx.world} processes with distributed.strategy fsdp2 (lockstep sampling)")


AUTO_CHECKPOINTING_SHARE = 0.5  # `gradient_checkpointing: auto` turns it on above this share of the free memory


def fit_memory(cfg: PipelineConfig, policy: Policy, records: list[dict[str, Any]], say=print) -> StepMemory:
    """Estimate the step's memory before the first step: turn gradient checkpointing on where `auto` says so, pick
    the allocator setting, and warn, with the knobs that lower it, when it still exceeds the free memory."""

    g = cfg.grpo
    shape = ModelShape.of(policy.model)
    prompt_tokens = longest_row(policy.tokenizer, policy.format_prompt, records[:256], 0)
    value_bytes = next(policy.model.parameters()).element_size()
    available = psutil.virtual_memory().available
    memory = estimate_step_memory(shape, g, prompt_tokens, policy.reference is not None, value_bytes)
    if g.gradient_checkpointing == "auto" and memory.peak > AUTO_CHECKPOINTING_SHARE * available:
        policy.set_gradient_checkpointing(True)
        say(f"grpo: gradient checkpointing on (grpo.gradient_checkpointing: auto): a step needs an estimated "
            f"{memory.peak / GiB:.1f} GB without it, over half the {available / GiB:.1f} GB free", flush=True)
    memory = estimate_step_memory(shape, replace(g, gradient_checkpointing="always" if policy.gradient_checkpointing
                                                 else "never"), prompt_tokens, policy.reference is not None,
                                  value_bytes)
    configure_allocator(memory.largest_activation)
    if memory.peak > available:
        say(f"grpo: warning: a step at max_completion_length {g.max_completion_length} needs an estimated "
            f"{memory.text()}, more than the {available / GiB:.1f} GB this machine has free; lower it with "
            f"{knobs(replace(g, gradient_checkpointing='always' if policy.gradient_checkpointing else 'never'))}",
            flush=True)
    return memory


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


def _distribute(policy: Policy, cfg: PipelineConfig, ctx: DistContext, say) -> None:
    """Wrap the model for DDP (FSDP2 sharded it already). DDP and FSDP need every forward through their wrapper,
    and per-group sampling promises the same result for any number of processes: both were built without the
    prompt-once forward."""
    g, backend = cfg.grpo, "nccl" if ctx.device.type == "cuda" else "gloo"
    if ctx.lockstep:
        say(f"grpo: {ctx.world} processes (FSDP2, {backend}): weights, gradients and optimizer state sharded; "
            f"{g.prompts_per_step} prompts per step shared between them")
    elif ctx.active:
        policy.trainer = wrap_ddp(policy.model, ctx)
        say(f"grpo: {ctx.world} processes (DDP, {backend}), {g.prompts_per_step} prompts per step shared between them")


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
