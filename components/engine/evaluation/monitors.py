"""Reward-hacking monitors and the not-learning diagnosis, read from GRPO's step history.

Both are pure functions of the history (one dict per step, with `heldout/<metric>` on the steps
that ran a held-out evaluation), so a resumed run replays them and reaches the same verdicts.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any

import torch

from components.config import MonitorsConfig, MonitorSpec, NoSignalConfig, NotLearningConfig
from components.config.monitors import LOGPROB_GAP_LIMIT

WINDOW_SIGNALS = ("kl", "entropy", "completion_length", "reward_mean", "zero_std_group_frac")


def _mean(rows: Sequence[dict[str, Any]], key: str) -> float | None:
    values = [r[key] for r in rows if key in r]
    return sum(values) / len(values) if values else None


def generalisation(history: Sequence[dict[str, Any]], end: int, window: int, keep_metric: str,
                   evals: Sequence[int]) -> dict[str, Any] | None:
    """The run so far in two numbers: how much the training reward rose, and how much the held-out
    `keep_metric` rose over the start model (paired, on the same prompts) with its noise (`1.96` standard
    errors). None before the first held-out evaluation that knows its start.

    The training reward's rise compares the mean of the last `w` steps with the first `w`, where `w` is
    `window` or the steps run divided by `4`, whichever is smaller (so a 20-step run compares 5 with 5)."""
    key = f"heldout/{keep_metric}_vs_start"
    if not evals or key not in history[evals[-1]]:
        return None
    w = min(window, max(1, end // 4))
    train_gain = (_mean(history[end - w:end], "reward_mean") or 0.0) - (_mean(history[:w], "reward_mean") or 0.0)
    row = history[evals[-1]]
    gain, noise = row[key], 1.96 * row.get(f"{key}_se", 0.0)
    return {"step": int(row["step"]), "metric": keep_metric, "train_gain": train_gain, "heldout_gain": gain,
            "heldout_noise": noise, "heldout_rose": bool(gain > noise)}


def generalisation_text(g: dict[str, Any], rose_by: float) -> str:
    """One line for the progress output and the model card; the training reward `rose` when it gained `rose_by`."""
    numbers = (f"training reward {g['train_gain']:+.3f}, held-out {g['metric']} {g['heldout_gain']:+.3f} "
               f"(noise ±{g['heldout_noise']:.3f}) over the start")
    if g["heldout_rose"]:
        return numbers + ": held-out rose"
    if g["train_gain"] < rose_by:
        return numbers + ": neither rose"
    return numbers + ": learning that does not generalise"


def signal_values(history: Sequence[dict[str, Any]], end: int, window: int, evaluations: int,
                  keep_metric: str, evals: Sequence[int] | None = None, final: bool = False) -> dict[str, float]:
    """Every signal at history[end - 1] (the signals that cannot be computed yet are left out).

    `evals`: the indices of history[:end] that hold a held-out evaluation, when the caller tracks them
    (a search of the whole history at every step would make a long run quadratic). `final`: history[end - 1]
    is the run's last step, the only one `heldout_flat` is judged at (over the whole run: on the default the
    held-out reward is flat for hundreds of steps before it climbs)."""
    key = f"heldout/{keep_metric}"
    evals = [i for i in range(end) if key in history[i]] if evals is None else evals
    run = generalisation(history, end, window, keep_metric, evals) if final else None
    judged = {"heldout_flat": 0.0 if run["heldout_rose"] else max(0.0, run["train_gain"])} if run else {}
    if "logprob_gap_mean" in history[end - 1]:  # judged every step: a kernel or cache bug shows from the first
        judged["logprob_gap"] = history[end - 1]["logprob_gap_mean"]
    if end < window:
        return judged
    rows = history[end - window:end]
    values = {name: v for name in WINDOW_SIGNALS if (v := _mean(rows, name)) is not None}
    first = history[0].get("completion_length")  # step 1 samples from the start policy, before any update
    if first and "completion_length" in values:
        values["completion_length_growth"] = values["completion_length"] / first - 1.0
    values.update(judged)
    if evals and "heldout/reward" in history[evals[-1]] and "reward_mean" in values:
        values["reward_heldout_gap"] = values["reward_mean"] - history[evals[-1]]["heldout/reward"]
    if len(evals) > evaluations:
        then, now = evals[-1 - evaluations], evals[-1]
        rose = (_mean(history[max(0, now + 1 - window):now + 1], "reward_mean") or 0.0) > \
            (_mean(history[max(0, then + 1 - window):then + 1], "reward_mean") or 0.0)
        drop = history[then][key] - history[now][key]
        values["heldout_drop"] = drop if rose and drop > 0 else 0.0
    return values


@dataclass
class Breach:
    """A check's first breach: where, by how much, and what it does to promotion."""

    signal: str
    rule: str
    action: str
    step: int
    value: float

    def text(self) -> str:
        return f"{self.signal} = {self.value:.4g} at step {self.step} (rule: {self.signal} {self.rule}; {self.action})"


def _breached(check: MonitorSpec, value: float) -> bool:
    return (check.above is not None and value > check.above) or (check.below is not None and value < check.below)


def _rule(check: MonitorSpec) -> str:
    return f"> {check.above:g}" if check.above is not None else f"< {check.below:g}"


def for_dtype(m: MonitorsConfig, dtype: torch.dtype) -> tuple[MonitorsConfig, str | None]:
    """The checks a run in `dtype` keeps: the on-policy check's default threshold was measured in float32, so a
    bfloat16 or float16 run leaves that check out (saying so) unless the user set its threshold themselves."""
    if dtype == torch.float32:
        return m, None
    dropped = [c for c in m.checks if c.signal == "logprob_gap" and c.above == LOGPROB_GAP_LIMIT]
    if not dropped:
        return m, None
    kept = replace(m, checks=[c for c in m.checks if c not in dropped])
    return kept, (f"monitor logprob_gap not checked: its default threshold ({LOGPROB_GAP_LIMIT:g}) is float32's and "
                  f"this run computes in {str(dtype).removeprefix('torch.')}; the gap is still logged: set "
                  "monitors.checks' logprob_gap `above` from a few steps' values to check it")


class Monitors:
    """Checks `monitors.checks` after every step; remembers each check's first breach."""

    def __init__(self, m: MonitorsConfig, keep_metric: str, steps: int | None = None):
        self.m, self.keep_metric, self.steps = m, keep_metric, steps
        self.breaches: dict[int, Breach] = {}
        self.last: dict[str, float] = {}
        self.evals: list[int] = []  # history indices with a held-out evaluation, seen so far

    def check(self, history: Sequence[dict[str, Any]], end: int | None = None) -> list[Breach]:
        """The checks first breached at history[end - 1] (default: the newest step)."""
        end = len(history) if end is None else end
        if f"heldout/{self.keep_metric}" in history[end - 1] and (not self.evals or self.evals[-1] < end - 1):
            self.evals.append(end - 1)
        final = self.steps is not None and int(history[end - 1]["step"]) == self.steps
        self.last = signal_values(history, end, self.m.window, self.m.evaluations, self.keep_metric,
                                  self.evals, final) or self.last
        new = []
        for i, check in enumerate(self.m.checks):
            value = self.last.get(check.signal)
            if i in self.breaches or value is None or not _breached(check, value):
                continue
            self.breaches[i] = Breach(check.signal, _rule(check), check.action, int(history[end - 1]["step"]), value)
            new.append(self.breaches[i])
        return new

    def replay(self, history: Sequence[dict[str, Any]]) -> None:
        """Rebuild the breaches of a resumed run from its checkpointed history."""
        for end in range(1, len(history) + 1):
            self.check(history, end)

    def summary(self) -> list[dict[str, Any]]:
        """One entry per check for metrics/grpo.json: its rule, action, first breach (if any) and last value."""
        out = []
        for i, check in enumerate(self.m.checks):
            breach = self.breaches.get(i)
            out.append({"signal": check.signal, "rule": _rule(check), "action": check.action,
                        "breached": breach is not None, "breach": asdict(breach) if breach else None,
                        "last_value": self.last.get(check.signal)})
        return out


REMEDIES = ("a stronger warm start (sft.stop_at_reward, more SFT data)",
            "dynamic sampling (grpo.dynamic_sampling.enabled: true) to train only on groups that differ",
            "a denser reward (partial credit, a format reward)", "another grpo.learning_rate")


def not_learning(history: Sequence[dict[str, Any]], c: NotLearningConfig) -> str | None:
    """Why this run does not seem to learn, with the likely remedies; None when it does (or it is too early).

    Compares the last `window` steps with the first `window`: the training reward must have risen by
    `min_reward_gain`. A run whose groups mostly score the same for every completion (all wrong)
    gets no gradient from them, the usual cause; groups that are all right mean the task is solved,
    so only all-wrong groups count as starving.
    """
    w = c.window
    if len(history) < 2 * w:
        return None
    first, last = _mean(history[:w], "reward_mean") or 0.0, _mean(history[-w:], "reward_mean") or 0.0
    if last - first >= c.min_reward_gain:
        return None
    starved = _mean(history[-w:], "all_fail_group_frac") or 0.0
    reason = (f"training reward {first:.3f} -> {last:.3f} (first vs last {w} steps, needs +{c.min_reward_gain:g})")
    if starved > c.zero_variance_above:
        reason += f"; {starved:.0%} of groups score zero on every completion, so they give no gradient"
    return f"not learning: {reason}. Try " + "; ".join(REMEDIES)


def no_signal(history: Sequence[dict[str, Any]], c: NoSignalConfig, total_steps: int,
              max_completion_length: int) -> str | None:
    """Said once, at step min(`c.steps`, the run's steps): most groups of the first steps scored every completion
    alike, so GRPO had nothing to learn from (None otherwise, and at every other step).

    A group whose completions all score the same has zero advantage. Some is normal (the default's first steps:
    benchmarks/results/heldout_curves.md); nearly all of them means the reward cannot tell completions apart: an answer
    extraction that misses, a prompt that does not ask for the answer's form, completions cut short."""
    at = min(c.steps, total_steps)
    if c.steps == 0 or len(history) != at:
        return None
    alike = _mean(history, "zero_std_group_frac") or 0.0
    if alike <= c.zero_variance_above:
        return None
    wrong = _mean(history, "all_fail_group_frac") or 0.0
    truncated = _mean(history, "truncated_frac") or 0.0
    text = (f"no signal: {alike:.0%} of groups in the first {at} steps scored every completion alike ({wrong:.0%} all "
            f"zero, {alike - wrong:.0%} all the same above zero), so they give GRPO no gradient")
    if wrong >= alike / 2:
        return text + (f". Likely causes: the reward's answer extraction (does it find the answer in the samples "
                       f"below?), the prompt template (prompt.template: does it ask for the answer's form?), the "
                       f"completion length (grpo.max_completion_length {max_completion_length}: {truncated:.0%} of "
                       f"completions were cut off)")
    return text + ". The start model already solves most prompts alike: harder prompts or a stricter reward"
