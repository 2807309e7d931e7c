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
from typing import Any, Callable, Sequence

import psutil
import torch

from components.config import ConfigError, GRPOConfig, PipelineConfig, config_warnings, stage_params_hash, to_flat_dict
from components.data.checkpoints import BEST, best_meta, discard_foreign, latest_checkpoint, load_weights, save_best
from components.data.paths import Paths
from components.data.records import dir_md5, file_md5, read_jsonl, split_path
from components.engine.distributed import DistContext, barrier, init, launch, needs_launch, shutdown, wrap_ddp
from components.engine.heldout import HeldoutProbe
from components.engine.host_memory import configure_allocator
from components.engine.memory_estimate import GiB, ModelShape, StepMemory, estimate_step_memory, knobs
from components.engine.modeling import load_policy_model, pick_device, resolve_model_dir, seed_everything
from components.engine.monitors import Monitors, generalisation, generalisation_text, no_signal
from components.engine.objectives import build_loss
from components.engine.policy import Policy, build_policy, longest_row, update_reference
from components.engine.rewards import RewardError, RewardModel
from components.engine.sampling import Batch, PromptSchedule, collect_batch, collect_batch_sharded, reward_specs
from components.engine.train_state import optimizer_and_resume, save_final_model, save_training_state
from components.engine.update import (
    UpdateStats,
    learning_rate,
    loss_mask,
    policy_updates,
    reference_logprobs,
    set_learning_rate,
)
from components.errors import StageFailed
from components.interruptions import set_progress
from components.run_marker import NoMarker, RunMarker, killed_run_text
from components.stages.cli import stage_main
from components.tracking.reports import GRPOReporter
from components.tracking.runs import tracking_run
from components.tracking.step_log import StepLog, write_step_outputs

MAX_BAD_STEPS = 3
StepCallback = Callable[[int, Any, dict[str, float]], None]


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
    policy = build_policy(cfg, start_dir, torch.device("cpu") if ctx.lockstep else ctx.device, records,
                          with_reference=loss.uses_reference)
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
    per_group = _distribute(policy, cfg, ctx, say)
    load_plain = lambda: load_policy_model(cfg, start_dir, torch.device("cpu"))  # noqa: E731 - fsdp2 gathers
    last_checkpoint, bad_steps, reward_failures = start_step, 0, 0
    # Held-out evaluation during training (rank 0; not with a sharded model) and the monitors reading it.
    probe = HeldoutProbe(cfg, paths, policy.tokenizer) if ctx.is_main and not ctx.lockstep and cfg.evaluate.every \
        else None
    monitors = Monitors(cfg.monitors, g.keep_metric, g.steps)
    monitors.replay(history)
    best = best_meta(paths.grpo_checkpoints, run_hash) if g.keep == "best" else None
    model_ids: dict[int, Any] = {}  # evaluated step -> its MLflow LoggedModel

    with tracking_run(ctx.is_main, cfg.tracking.experiment, "grpo", to_flat_dict(cfg)) as run:
        run.set_tags({"grpo.resumed_from_step": start_step})
        reporter = GRPOReporter(run, policy.tokenizer, g.group_size, cfg.reports)
        log = StepLog(run, g, start_step, history, ctx.is_main, cfg.monitors.not_learning,
                      cfg.tracking.metrics_flush_s)
        if probe is not None:  # the held-out curve's step 0: the model GRPO starts from
            _evaluate_start(probe, policy, cfg, start_dir, start_step, ctx, run, say)
        for step in range(start_step, g.steps):
            set_progress(f"at step {step + 1} of {g.steps}; " + (f"the last checkpoint is step {last_checkpoint}"
                                                                 if last_checkpoint else "no checkpoint yet"))
            t_step = time.perf_counter()
            set_learning_rate(optimizer, learning_rate(step, g))
            # 1. sample G completions per prompt and score them
            try:
                batch = (collect_batch_sharded(policy, records, schedule, step, g, rewards, cfg.seed, ctx) if per_group
                         else collect_batch(policy, records, schedule, step, g, rewards, rollout_gen))
            except RewardError as err:
                reward_failures = _reward_failure(err, step, reward_failures, g.max_reward_failures, run, say)
                continue
            reward_failures, t_sampled = 0, time.perf_counter()
            # 2. advantages; completions no reward scored (NaN) get advantage 0 and stay out of the loss
            totals = torch.tensor(batch.totals, dtype=torch.float32, device=ctx.device)
            scorable = ~torch.isnan(totals)
            advantages = loss.advantages(totals)
            mask = loss_mask(batch.rollout, scorable, g.mask_truncated_completions)
            t_advantages = time.perf_counter()
            # 3. reference log-probs, once per step, only when the loss has a KL term
            ref_logp = (reference_logprobs(policy, batch.rollout, g, ctx)
                        if loss.uses_reference and len(batch.rollout) else None)
            t_reference = time.perf_counter()
            # 4. the policy update
            stats = (policy_updates(policy, optimizer, batch.rollout, advantages, mask, ref_logp, g, ctx, scorable,
                                    loss) if len(batch.rollout) else UpdateStats())
            t_policy = time.perf_counter()
            bad_steps = _count_bad_steps(stats, step, bad_steps, paths, say)
            # 5. move the reference (ema / periodic)
            if moving_reference:
                update_reference(policy.reference, policy.model, g.reference.mode, step, g.reference.ema_alpha,
                                 g.reference.sync_every)
            # 6. log
            timings = {"generation": t_sampled - t_step - batch.reward_seconds,
                       "reward": t_advantages - t_sampled + batch.reward_seconds,
                       "reference": t_reference - t_advantages, "policy": t_policy - t_reference,
                       "step": time.perf_counter() - t_step}
            metrics = step_metrics(batch, stats, advantages, scorable, optimizer.param_groups[0]["lr"], timings, g)
            if probe is not None and probe.due(step + 1) and (scores := _heldout(probe, policy.model, step + 1, say)):
                # 6b. held-out metrics; the best weights kept aside
                metrics.update({f"heldout/{k}": v for k, v in scores.items()})
                best = _keep_best(best, step + 1, scores, policy, run_hash, paths, g, say)
                # The run's `heldout/...` curves and the checkpoint's LoggedModel share these points.
                saved = g.checkpoint_every and (step + 1) % g.checkpoint_every == 0 and step + 1 < g.steps
                model_ids[step + 1] = run.log_checkpoint_model(
                    f"grpo-step-{step + 1:07d}", step + 1, {f"heldout/{k}": v for k, v in scores.items()},
                    {"grpo.step": step + 1, "grpo.run_hash": run_hash, "grpo.keep_metric": g.keep_metric,
                     "grpo.checkpoint": str(paths.grpo_checkpoints / f"step-{step + 1:07d}") if saved else "none"})
            log.record(step + 1, metrics)
            if ctx.is_main:
                _warn_if_no_signal(history, cfg, batch, reporter, run, say)
            for breach in monitors.check(history) if ctx.is_main else ():
                say(f"grpo: monitor breached: {breach.text()}", flush=True)
                run.set_tags({f"monitor.{breach.signal}": breach.text()})
            for callback in callbacks if ctx.is_main else ():
                callback(step + 1, policy.model, metrics)
            if ctx.is_main:
                reporter.on_step(step + 1, batch.rollout, batch.first_scores, advantages, final=step + 1 == g.steps)
            # 7. checkpoint (never inside a non-finite streak)
            if g.checkpoint_every and (step + 1) % g.checkpoint_every == 0 and step + 1 < g.steps and not bad_steps:
                save_training_state(paths.grpo_checkpoints, step + 1, run_hash, policy, optimizer, moving_reference,
                                    history, rollout_gen, ctx, load_plain)
                last_checkpoint = step + 1
            if (step + 1) % g.log_every == 0 or last_checkpoint == step + 1:
                marker.write(step=step + 1, last_checkpoint=last_checkpoint)

        log.flush()
        kept = {"mode": g.keep, "step": g.steps, "metric": g.keep_metric,
                "value": history[-1].get(f"heldout/{g.keep_metric}") if history else None}
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
        if model_ids.get(kept["step"]):
            run.set_model_tags(model_ids[kept["step"]], {"grpo.kept": f"models/grpo ({g.keep})"})
        reporter.finish(history, paths.plots)
    return summary


def step_metrics(batch: Batch, stats: UpdateStats, advantages: torch.Tensor, scorable: torch.Tensor, lr: float,
                 seconds: dict[str, float], g: GRPOConfig) -> dict[str, float]:
    """One step's row of plots/grpo_steps.csv (MLflow groups them: tracking/step_log.py)."""
    rollout, first = batch.rollout, torch.tensor(batch.first_scores.total)
    grouped = first.view(-1, g.group_size)
    metrics = {
        "loss": stats.loss, "pg_loss": stats.pg_loss, "kl": stats.kl,
        "reward_mean": float(first.mean()), "reward_std": float(first.std()) if len(first) > 1 else 0.0,
        "advantage_mean": float(advantages.mean()) if len(advantages) else 0.0,
        "logprob_mean": stats.logprob_mean, "entropy": stats.entropy,
        "completion_length": float(rollout.completion_mask.sum(-1).float().mean()) if len(rollout) else 0.0,
        "completion_length_max": float(rollout.completion_mask.sum(-1).max()) if len(rollout) else 0.0,
        "truncated_frac": float(rollout.truncated.float().mean()) if len(rollout) else 0.0,
        "distinct_completion_frac": rollout.distinct_fraction(),
        "zero_std_group_frac": float((grouped.max(1).values == grouped.min(1).values).float().mean()),
        "all_fail_group_frac": float((grouped.max(1).values <= 0).float().mean()),
        "kept_completions": float(len(rollout)), "sampled_completions": float(batch.sampled),
        "unscored_completions": float((~scorable).sum()),
        "grad_norm": stats.grad_norm, "learning_rate": lr, "clip_low_frac": stats.clip_low_frac,
        "clip_high_frac": stats.clip_high_frac, "step_seconds": seconds["step"],
        "completions_per_s": batch.sampled / seconds["step"], "time/generation": seconds["generation"],
        "time/reward": seconds["reward"], "time/reference": seconds["reference"], "time/policy": seconds["policy"],
        "time/policy_forward": stats.forward_seconds, "time/policy_backward": stats.backward_seconds,
        "time/optimizer": stats.optimizer_seconds,
    }
    metrics.update({f"reward/{k}/mean": v for k, v in batch.first_scores.component_means().items()})
    return metrics


# ---- the details the loop above hides: the held-out start, the best checkpoint, multi-process set-up, resume,
# failure streaks

def _warn_if_no_signal(history: list[dict[str, Any]], cfg: PipelineConfig, batch: Batch, reporter: GRPOReporter,
                       run, say) -> None:
    """Once, early: the first steps' groups scored every completion alike (two samples shown to say why)."""
    silent = no_signal(history, cfg.monitors.no_signal, cfg.grpo.steps, cfg.grpo.max_completion_length)
    if silent:
        say(f"grpo: WARNING at step {history[-1]['step']}: {silent}\n"
            + reporter.samples_text(batch.rollout, batch.first_scores), flush=True)
        run.set_tags({"warning.no_signal": f"step {history[-1]['step']}: {silent}"})


def _flat_threshold(cfg: PipelineConfig) -> float:
    """The training-reward rise that counts as learning: the `heldout_flat` check's, else not-learning's."""
    return next((c.above for c in cfg.monitors.checks if c.signal == "heldout_flat" and c.above is not None),
                cfg.monitors.not_learning.min_reward_gain)


def _heldout(probe: HeldoutProbe, model, step: int, say) -> dict[str, float] | None:
    """The held-out metrics at `step`, or None (said once) when a reward failed on them: evaluation never stops
    training; the training steps meet the same reward and handle its failures by their own rule."""
    try:
        return probe(model)
    except RewardError as err:
        say(f"grpo: held-out evaluation at step {step} skipped ({err})")
        return None


def _evaluate_start(probe: HeldoutProbe, policy: Policy, cfg: PipelineConfig, start_dir: Path, start_step: int,
                    ctx: DistContext, run, say) -> None:
    """Evaluate the model GRPO starts from on the held-out probe (a resumed run reloads it from its directory:
    greedy decoding gives the same scores), so every later evaluation is a paired change over the start."""
    model = policy.model if start_step == 0 else load_policy_model(cfg, start_dir, ctx.device)
    try:
        scores = probe.set_origin(model)
    except RewardError as err:  # the training steps meet the same reward and handle its failures
        say(f"grpo: held-out evaluation of the start model skipped ({err}); later ones are not compared with it")
        return
    finally:
        del model
    run.log_metrics({f"heldout/{k}": v for k, v in scores.items()}, step=0)
    say("grpo: held-out at the start " + ", ".join(f"{k} {v:.3f}" for k, v in scores.items()), flush=True)


def _keep_best(best: dict[str, Any] | None, step: int, scores: dict[str, float], policy: Policy, run_hash: str,
               paths: Paths, g: GRPOConfig, say) -> dict[str, Any] | None:
    """With `grpo.keep: best`, save the weights when this evaluation beats every earlier one (ties keep the earlier)."""
    value = scores[g.keep_metric]
    if g.keep != "best" or (best is not None and value <= best["value"]):
        return best
    save_best(paths.grpo_checkpoints, step, run_hash, policy.model, g.keep_metric, value)
    say(f"grpo: step {step}: new best held-out {g.keep_metric} {value:.4f}", flush=True)
    return {"step": step, "metric": g.keep_metric, "value": value}


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
    """Drop checkpoints trained from other inputs and damaged ones (rank 0, each said), then the newest intact
    one of this run, if any."""
    found = None
    if ctx.is_main:
        for stale in discard_foreign(paths.grpo_checkpoints, run_hash):
            print(f"grpo: removed checkpoint {stale} (trained from other inputs)")
        # A DVC output even when the run is shorter than checkpoint_every (or checkpointing is off).
        paths.grpo_checkpoints.mkdir(parents=True, exist_ok=True)
        skipped: list[str] = []
        found = latest_checkpoint(paths.grpo_checkpoints, run_hash, lambda line: (print(line), skipped.append(line)),
                                  remove_damaged=True)
        if found is None and skipped:
            print("grpo: no intact checkpoint of this run is left: starting from step 0")
    barrier(ctx)
    return found if ctx.is_main else latest_checkpoint(paths.grpo_checkpoints, run_hash, lambda *_: None)


def _distribute(policy: Policy, cfg: PipelineConfig, ctx: DistContext, say) -> bool:
    """Wrap the model for DDP (FSDP2 sharded it already); returns whether sampling is per group.

    DDP and FSDP need every forward through their wrapper, and per-group sampling promises the same
    result for any number of processes: both use the plain forward, not the prompt-once one.
    """
    g, backend = cfg.grpo, "nccl" if ctx.device.type == "cuda" else "gloo"
    per_group = ctx.active or cfg.distributed.per_group_sampling
    if per_group:
        policy.fast = policy.fast_reference = None
    if ctx.lockstep:
        say(f"grpo: {ctx.world} processes (FSDP2, {backend}): weights, gradients and optimizer state sharded; "
            f"{g.prompts_per_step} prompts per step shared between them")
    elif ctx.active:
        policy.trainer = wrap_ddp(policy.model, ctx)
        say(f"grpo: {ctx.world} processes (DDP, {backend}), {g.prompts_per_step} prompts per step shared between them")
    return per_group


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
