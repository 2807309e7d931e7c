"""What the GRPO loop does after each update, behind three calls: the step's metrics (`step_metrics`), the
held-out evaluation when it is due (`HeldoutDuringTraining`: the start model at step 0, the best weights kept
aside) and everything that watches a step (`StepWatch`: MLflow and the progress line, the early no-signal
warning, the monitors, callbacks and sample reports); and after the last step, the run's summary (`report_run`).
Imported by stages/grpo.py only.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from components.config import GRPOConfig, PipelineConfig
from components.data.checkpoints import save_best
from components.data.paths import Paths
from components.engine.evaluation.heldout import HeldoutProbe
from components.engine.evaluation.monitors import Monitors, generalisation, generalisation_text, no_signal
from components.engine.generation.rollouts import Episode
from components.engine.grpo.batch import Batch
from components.engine.grpo.policy import Policy
from components.engine.grpo.trajectory import Trajectory
from components.engine.grpo.update import UpdateStats
from components.engine.models.modeling import load_policy_model
from components.engine.parallel.distributed import DistContext
from components.engine.rewards.rewards import RewardError
from components.tracking.reports import GRPOReporter
from components.tracking.step_log import StepLog, write_step_outputs

StepCallback = Callable[[int, Any, dict[str, float]], None]


def checkpoint_due(step: int, g: GRPOConfig) -> bool:
    """A training checkpoint after `step` steps (the last step saves the final model instead)."""
    return bool(g.checkpoint_every) and step % g.checkpoint_every == 0 and step < g.steps


def phase_seconds(t_step: float, t_sampled: float, t_reference: float, t_policy: float, t_end: float,
                  reward_seconds: float) -> dict[str, float]:
    """A step's seconds by phase from its timestamps (reward time measured inside sampling moved to `reward`; the
    policy phase holds the trajectory and any old log-probs)."""
    return {"generation": t_sampled - t_step - reward_seconds, "reward": reward_seconds,
            "reference": t_reference - t_sampled, "policy": t_policy - t_reference, "step": t_end - t_step}


def step_metrics(batch: Batch, stats: UpdateStats, trajectory: Trajectory, lr: float,
                 seconds: dict[str, float]) -> dict[str, float]:
    """One step's row of plots/grpo_steps.csv (MLflow groups them: tracking/step_log.py)."""
    rollout, first = batch.rollouts, torch.tensor(batch.rewards.total)
    written = rollout.written  # the model's tokens: what completion_length counts everywhere
    advantages, scorable = trajectory.advantages, trajectory.scorable
    grouped = rollout.by_group(first)
    metrics = {
        "loss": stats.loss, "pg_loss": stats.pg_loss, "kl": stats.kl,
        "reward_mean": float(first.mean()), "reward_std": float(first.std()) if len(first) > 1 else 0.0,
        "advantage_mean": float(advantages.mean()) if len(advantages) else 0.0,
        "logprob_mean": stats.logprob_mean, "entropy": stats.entropy,
        "completion_length": float(written.sum(-1).float().mean()) if len(rollout) else 0.0,
        "completion_length_max": float(written.sum(-1).max()) if len(rollout) else 0.0,
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
    if stats.gap_tokens:  # the on-policy check (absent where the rollout carries no sampler log-probs)
        metrics["logprob_gap_mean"] = stats.gap_sum / stats.gap_tokens
        metrics["logprob_gap_max"] = stats.gap_max
    metrics.update(stats.correction.metrics())  # rollout_correction/*: none with the correction off
    metrics.update({f"reward/{k}/mean": v for k, v in batch.rewards.component_means().items()})
    metrics.update(episode_metrics(rollout.episodes))
    return metrics


def episode_metrics(episodes: Sequence[Episode]) -> dict[str, float]:
    """What a step's rows did as episodes (a single turn is an episode of one turn): turns, tool calls and errors,
    the share cut by a limit, every token after the prompt (`episode_length`), those a tool or environment wrote,
    and the share of them the model wrote (the rest stays out of the loss)."""
    n, tokens = max(len(episodes), 1), sum(len(e.ids) for e in episodes)
    return {"turns_per_episode": sum(e.turns for e in episodes) / n,
            "tool_calls_per_episode": sum(e.tool_calls for e in episodes) / n,
            "tool_errors_per_episode": sum(e.tool_errors for e in episodes) / n,
            "episodes_cut_frac": sum(e.cut is not None for e in episodes) / n,
            "episode_length": tokens / n, "environment_tokens": sum(e.environment_tokens for e in episodes) / n,
            "episode_model_token_frac": sum(e.model_tokens for e in episodes) / tokens if tokens else 1.0}


class HeldoutDuringTraining:
    """The held-out curve of a run (rank 0; none with a sharded model or `evaluate.every: 0`): the start model at
    step 0, then every `evaluate.every` steps, each point logged with its checkpoint's LoggedModel; with
    `grpo.keep: best` the best weights are saved aside."""

    def __init__(self, probe: HeldoutProbe | None, cfg: PipelineConfig, paths: Paths, run, run_hash: str,
                 best: dict[str, Any] | None, say):
        self.probe, self.cfg, self.paths, self.run, self.run_hash, self.say = probe, cfg, paths, run, run_hash, say
        self.best = best  # {step, metric, value} of the best evaluation so far (grpo.keep: best)
        self.model_ids: dict[int, Any] = {}  # evaluated step -> its MLflow LoggedModel

    def evaluate_start(self, policy: Policy, start_dir: Path, start_step: int, ctx: DistContext) -> None:
        """Evaluate the model GRPO starts from (a resumed run reloads it from its directory: greedy decoding gives
        the same scores), so every later evaluation is a paired change over the start."""
        if self.probe is None:
            return
        model = policy.model if start_step == 0 else load_policy_model(self.cfg, start_dir, ctx.device)
        try:
            scores = self.probe.set_origin(model)
        except RewardError as err:  # the training steps meet the same reward and handle its failures
            self.say(f"grpo: held-out evaluation of the start model skipped ({err}); later ones are not compared "
                     "with it")
            return
        finally:
            del model
        self.run.log_metrics({f"heldout/{k}": v for k, v in scores.items()}, step=0)
        self.say("grpo: held-out at the start " + ", ".join(f"{k} {v:.3f}" for k, v in scores.items()), flush=True)

    def __call__(self, step: int, metrics: dict[str, float], policy: Policy) -> None:
        """When due, add `heldout/...` to the step's metrics, keep the best weights and log the LoggedModel."""
        if self.probe is None or not self.probe.due(step):
            return
        scores = self._scores(policy.model, step)
        if not scores:
            return
        g = self.cfg.grpo
        metrics.update({f"heldout/{k}": v for k, v in scores.items()})
        self._keep_best(step, scores, policy)
        saved = checkpoint_due(step, g)
        self.model_ids[step] = self.run.log_checkpoint_model(
            f"grpo-step-{step:07d}", step, {f"heldout/{k}": v for k, v in scores.items()},
            {"grpo.step": step, "grpo.run_hash": self.run_hash, "grpo.keep_metric": g.keep_metric,
             "grpo.checkpoint": str(self.paths.grpo_checkpoints / f"step-{step:07d}") if saved else "none"})

    def _scores(self, model, step: int) -> dict[str, float] | None:
        """The held-out metrics, or None (said once) when a reward failed on them: evaluation never stops
        training; the training steps meet the same reward and handle its failures by their own rule."""
        try:
            return self.probe(model)
        except RewardError as err:
            self.say(f"grpo: held-out evaluation at step {step} skipped ({err})")
            return None

    def _keep_best(self, step: int, scores: dict[str, float], policy: Policy) -> None:
        """With `grpo.keep: best`, save the weights when this evaluation beats every earlier one (ties keep the
        earlier)."""
        g = self.cfg.grpo
        value = scores[g.keep_metric]
        if g.keep != "best" or (self.best is not None and value <= self.best["value"]):
            return
        save_best(self.paths.grpo_checkpoints, step, self.run_hash, policy.model, g.keep_metric, value)
        self.say(f"grpo: step {step}: new best held-out {g.keep_metric} {value:.4f}", flush=True)
        self.best = {"step": step, "metric": g.keep_metric, "value": value}


class StepWatch:
    """Everything that reads a finished step: the step log (MLflow windows, the progress line), and on rank 0 the
    early no-signal warning, the monitors, the callers' callbacks and the sample reports."""

    def __init__(self, cfg: PipelineConfig, run, log: StepLog, history: list[dict[str, Any]], monitors: Monitors,
                 reporter: GRPOReporter, callbacks: Sequence[StepCallback], is_main: bool, say):
        self.cfg, self.run, self.log, self.history, self.monitors = cfg, run, log, history, monitors
        self.reporter, self.callbacks, self.is_main, self.say = reporter, callbacks, is_main, say

    def __call__(self, step: int, metrics: dict[str, float], batch: Batch, trajectory: Trajectory, model) -> None:
        self.log.record(step, metrics)
        if not self.is_main:
            return
        self._warn_if_no_signal(batch)
        for breach in self.monitors.check(self.history):
            self.say(f"grpo: monitor breached: {breach.text()}", flush=True)
            self.run.set_tags({f"monitor.{breach.signal}": breach.text()})
        for callback in self.callbacks:
            callback(step, model, metrics)
        self.reporter.on_step(step, batch.rollouts, batch.rewards, trajectory.advantages,
                              final=step == self.cfg.grpo.steps)

    def _warn_if_no_signal(self, batch: Batch) -> None:
        """Once, early: the first steps' groups scored every completion alike (two samples shown to say why)."""
        cfg = self.cfg
        silent = no_signal(self.history, cfg.monitors.no_signal, cfg.grpo.steps, cfg.grpo.max_completion_length)
        if silent:
            step = self.history[-1]["step"]
            self.say(f"grpo: WARNING at step {step}: {silent}\n"
                     + self.reporter.samples_text(batch.rollouts, batch.rewards), flush=True)
            self.run.set_tags({"warning.no_signal": f"step {step}: {silent}"})


def report_run(cfg: PipelineConfig, paths: Paths, run, kept: dict[str, Any], history: list[dict[str, Any]],
               probe: HeldoutProbe | None, monitors: Monitors, log: StepLog, heldout: HeldoutDuringTraining,
               reporter: GRPOReporter, say) -> dict[str, Any]:
    """After the last step (rank 0): the held-out evaluations and the verdict over the run, metrics/grpo.json and
    the step table, the run's tags and figures. Returns the summary written."""
    g = cfg.grpo
    evaluations = [{"step": h["step"], **{k.removeprefix("heldout/"): v for k, v in h.items()
                                          if k.startswith("heldout/")}} for h in history
                   if any(k.startswith("heldout/") for k in h)]
    if probe is not None:
        evaluations.insert(0, {"step": 0, **{k: round(v, 6) for k, v in probe.origin_scores.items()}})
    run_verdict = generalisation(history, len(history), cfg.monitors.window, g.keep_metric, monitors.evals)
    if run_verdict:
        run_verdict["text"] = generalisation_text(run_verdict, flat_threshold(cfg))
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


def flat_threshold(cfg: PipelineConfig) -> float:
    """The training-reward rise that counts as learning: the `heldout_flat` check's, else not-learning's."""
    return next((c.above for c in cfg.monitors.checks if c.signal == "heldout_flat" and c.above is not None),
                cfg.monitors.not_learning.min_reward_gain)
