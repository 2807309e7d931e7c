"""GRPO's per-step record: the step history (plots/grpo_steps.csv, metrics/grpo.json), one MLflow point
per `grpo.metrics_every` steps (written to the store together at most every `tracking.metrics_flush_s`
seconds), and a progress line with rate and ETA every `grpo.log_every` steps."""

from __future__ import annotations

import csv
import json
import time
from typing import Any

from components.config import GRPOConfig, NotLearningConfig
from components.data.paths import Paths
from components.engine.evaluation.monitors import not_learning

# MLflow's run page shows one section of charts per prefix before "/", sections in alphabetical order
# (unprefixed charts last): the charts that say whether training works come first as `learning/`, then
# episode/ (tools and environments), optim/, reward/<name>/, rollout/, time/ (plots/grpo_steps.csv keeps the plain
# names).
METRIC_GROUPS = {
    "learning": ("reward_mean", "reward_std", "kl", "entropy", "completion_length", "completion_length_max"),
    "optim": ("loss", "pg_loss", "advantage_mean", "logprob_mean", "grad_norm", "learning_rate", "clip_low_frac",
              "clip_high_frac"),
    "rollout": ("truncated_frac", "distinct_completion_frac", "zero_std_group_frac", "all_fail_group_frac",
                "kept_completions", "sampled_completions", "unscored_completions", "reward_failures",
                "logprob_gap_mean", "logprob_gap_max"),
    "time": ("step_seconds", "completions_per_s"),
    "episode": ("turns_per_episode", "tool_calls_per_episode", "tool_errors_per_episode", "episodes_cut_frac",
                "episode_length", "environment_tokens", "episode_model_token_frac"),
}
_GROUP_OF = {key: group for group, keys in METRIC_GROUPS.items() for key in keys}


def mlflow_metric_names(metrics: dict[str, float]) -> dict[str, float]:
    """`grad_norm` -> `optim/grad_norm`, `kl` -> `learning/kl`; `time/...` and `reward/...` as they are."""
    return {(f"{_GROUP_OF[k]}/{k}" if k in _GROUP_OF else k): v for k, v in metrics.items()}


def window_mean(rows: list[dict[str, float]]) -> dict[str, float]:
    """Each metric's mean over the steps that have it: one MLflow point per window, not per step."""
    keys = dict.fromkeys(k for row in rows for k in row)
    return {k: sum(row[k] for row in rows if k in row) / sum(1 for row in rows if k in row) for k in keys}


class StepLog:
    """Collects each step's metrics; logs windows to MLflow and prints progress (rank 0 only).

    Held-out metrics (`heldout/...`, on the steps that ran an evaluation) are not averaged into a window:
    the stage logs them at their own step, linked to that checkpoint's LoggedModel. The progress line says when
    the run is not learning (engine/evaluation/monitors.py),
    and so does the run's tag `warning.not_learning`.
    """

    def __init__(self, run, g: GRPOConfig, start_step: int, history: list[dict[str, Any]], is_main: bool,
                 not_learning_cfg: NotLearningConfig | None = None, flush_s: float = 0.0):
        self.run, self.g, self.start_step, self.history, self.is_main = run, g, start_step, history, is_main
        self.flush_s = flush_s
        self.not_learning_cfg = not_learning_cfg
        self.window: list[dict[str, float]] = []
        self.started = self.flushed = time.perf_counter()
        self.warning: str | None = None

    def record(self, step: int, metrics: dict[str, float]) -> None:
        """`step` is 1-based: the number of steps done."""
        # 7 significant digits: small figures (the on-policy gap, ~1e-7) keep theirs, large ones their sense
        self.history.append({"step": step, **{k: float(f"{v:.7g}") for k, v in metrics.items()}})
        heldout = {k: v for k, v in metrics.items() if k.startswith("heldout/")}  # MLflow: with its LoggedModel
        self.window.append({k: v for k, v in metrics.items() if k not in heldout})
        if step % self.g.metrics_every == 0:
            self.run.log_metrics(mlflow_metric_names(window_mean(self.window)), step=step, flush=False)
            self.window = []
            if time.perf_counter() - self.flushed >= self.flush_s:
                self.run.flush()  # one write for all pending points: most of a write's cost is per write
                self.flushed = time.perf_counter()
        if self.is_main and (step % self.g.log_every == 0 or step == self.g.steps):
            rate = (step - self.start_step) / (time.perf_counter() - self.started)
            eta = (self.g.steps - step) / rate if rate > 0 else float("inf")
            recent = self.history[-self.g.log_every:]
            mean_reward = sum(h["reward_mean"] for h in recent) / len(recent)
            line = (f"grpo: step {step}/{self.g.steps} reward {mean_reward:.3f} kl {metrics['kl']:.4f} "
                    f"loss {metrics['loss']:+.4f} | {rate:.2f} steps/s, {metrics['completions_per_s']:.0f} "
                    f"completions/s, ETA {eta:.0f}s")
            if heldout:
                line += " | held-out " + heldout_text({k.removeprefix("heldout/"): v for k, v in heldout.items()})
            self.warning = not_learning(self.history, self.not_learning_cfg) if self.not_learning_cfg else None
            if self.warning:
                line += f"\ngrpo: WARNING at step {step}: {self.warning}"
                self.run.set_tags({"warning.not_learning": f"step {step}: {self.warning}"})
            print(line, flush=True)

    def flush(self) -> None:
        """The last, partial window (also when the last steps were skipped), and every point still pending."""
        if self.window:
            self.run.log_metrics(mlflow_metric_names(window_mean(self.window)), step=self.history[-1]["step"],
                                 flush=False)
            self.window = []
        self.run.flush()


def heldout_text(scores: dict[str, float]) -> str:
    """`reward 0.520 (+0.100 ±0.060 vs start), eos_rate 1.000`: the change over the start model beside its metric."""
    parts = []
    for name, value in scores.items():
        if name.endswith(("_vs_start", "_vs_start_se")):
            continue
        part = f"{name} {value:.3f}"
        if f"{name}_vs_start" in scores:
            noise = 1.96 * scores.get(f"{name}_vs_start_se", 0.0)
            part += f" ({scores[f'{name}_vs_start']:+.3f} ±{noise:.3f} vs start)"
        parts.append(part)
    return ", ".join(parts)


def write_step_outputs(history: list[dict[str, Any]], paths: Paths, extra: dict[str, Any] | None = None
                       ) -> dict[str, Any]:
    """Per-step CSV (DVC plots) and a small summary JSON (DVC metrics), plus `extra` (kept checkpoint,
    monitors, held-out evaluations)."""
    paths.plots.mkdir(parents=True, exist_ok=True)
    paths.metrics.mkdir(parents=True, exist_ok=True)
    keys = list(dict.fromkeys(k for row in history for k in row)) or ["step"]  # held-out columns on some rows only
    with (paths.plots / "grpo_steps.csv").open("w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=keys, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(history)
    tail = history[-max(1, len(history) // 10):]
    summary = {"steps": len(history),
               "reward_mean_first10pct": _mean(history[: max(1, len(history) // 10)], "reward_mean"),
               "reward_mean_last10pct": _mean(tail, "reward_mean"), "kl_last": history[-1]["kl"] if history else 0.0,
               **(extra or {})}
    (paths.metrics / "grpo.json").write_text(json.dumps(summary, indent=2, sort_keys=True) + "\n")
    return summary


def _mean(rows: list[dict[str, Any]], key: str) -> float:
    return round(sum(r[key] for r in rows) / len(rows), 6) if rows else 0.0
