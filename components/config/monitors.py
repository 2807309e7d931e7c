"""Reward-hacking monitors and the not-learning and no-signal warnings, with their checks."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from components.config.rules import _require

LOGPROB_GAP_LIMIT = 1e-3
"""The on-policy check's default threshold on a step's mean gap: about 150 times the largest step mean measured in
float32 on the CPU (6.5e-6 on the SmolLM2 example, 3.7e-7 on the default; docs/engine.md, "On-policy check"), and
below what a real disagreement gives (a sampler at another temperature: above 1e-2)."""


@dataclass
class MonitorSpec:
    """One reward-hacking check: a signal (components/engine/evaluation/monitors.py) against a threshold."""

    signal: Literal["kl", "entropy", "completion_length", "completion_length_growth", "reward_mean",
                    "zero_std_group_frac", "reward_heldout_gap", "heldout_drop", "heldout_flat",
                    "logprob_gap"] = "heldout_drop"
    """kl, entropy, completion_length, reward_mean, zero_std_group_frac: means over the last `window` steps;
    completion_length_growth: that mean over step 1's (sampled from the start policy), minus 1;
    reward_heldout_gap: training reward minus the last held-out `reward`; heldout_drop: how far the held-out
    `grpo.keep_metric` fell over the last `evaluations` evaluations while the training reward rose (0
    otherwise); heldout_flat: judged once, at the last step: the training reward's rise over the run when the
    held-out `grpo.keep_metric` did not rise over the start model by more than its noise (1.96 paired
    standard errors), 0 otherwise; logprob_gap: the newest step's mean |sampler log-prob - trainer log-prob| over
    the sampled tokens (the on-policy check: the same weights and maths give rounding only)."""
    above: float | None = None
    """Breached when the signal exceeds this."""
    below: float | None = None
    """Breached when the signal falls under this."""
    action: Literal["block", "warn"] = "block"
    """block: the version is registered but never made champion; warn: tagged and printed only."""


@dataclass
class NotLearningConfig:
    """When to say, while training runs, that GRPO is not learning (and what to try)."""

    window: int = 400
    """Steps compared: the last `window` steps against the first `window`, once 2 * window steps ran. On the
    default the reward is flat for its first ~300 steps, then climbs: 400 leaves room for a slower start."""
    min_reward_gain: float = 0.05
    """Flat: the training reward's mean over the last window exceeds the first window's by less than this."""
    zero_variance_above: float = 0.5
    """Starved (named as the likely cause): over the last window, more than this share of groups scored
    zero on every completion."""


@dataclass
class NoSignalConfig:
    """The early warning that the first steps carry no learning signal (every completion of a group scored alike)."""

    steps: int = 10
    """Judged once, after this many steps (or at the last step of a shorter run); 0 turns it off."""
    zero_variance_above: float = 0.9
    """Said when, over those steps, more than this share of groups scored every completion the same."""


@dataclass
class MonitorsConfig:
    """Reward-hacking monitors (a breach is an MLflow tag; `block` keeps the version from `champion`)
    and the not-learning warning."""

    window: int = 50
    """Steps averaged for the per-step signals."""
    evaluations: int = 3
    """Held-out evaluations (evaluate.every) spanned by `heldout_drop`."""
    checks: list[MonitorSpec] = field(default_factory=lambda: [
        MonitorSpec("heldout_drop", above=0.05, action="block"),
        MonitorSpec("heldout_flat", above=0.1, action="warn"),
        MonitorSpec("completion_length_growth", above=1.0, action="warn"),
        MonitorSpec("logprob_gap", above=LOGPROB_GAP_LIMIT, action="warn")])
    """The checks; every breach is recorded with its step and value."""
    not_learning: NotLearningConfig = field(default_factory=NotLearningConfig)
    """The not-learning warning."""
    no_signal: NoSignalConfig = field(default_factory=NoSignalConfig)
    """The early no-signal warning."""


def check_monitors(m: MonitorsConfig) -> None:
    """monitors: windows, each check's threshold, the warnings' shares."""
    _require(m.window >= 1, "monitors.window", "must be >= 1")
    _require(m.evaluations >= 1, "monitors.evaluations", "must be >= 1")
    for i, check in enumerate(m.checks):
        _require((check.above is None) != (check.below is None), f"monitors.checks[{i}]",
                 f"{check.signal}: set exactly one of above or below")
    _require(m.not_learning.window >= 1, "monitors.not_learning.window", "must be >= 1")
    _require(m.no_signal.steps >= 0, "monitors.no_signal.steps", "must be >= 0 (0 = off)")
    _require(0 < m.no_signal.zero_variance_above <= 1, "monitors.no_signal.zero_variance_above", "must be in (0, 1]")
    _require(0 < m.not_learning.zero_variance_above <= 1, "monitors.not_learning.zero_variance_above",
             "must be in (0, 1]")
