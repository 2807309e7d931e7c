"""Held-out evaluation and the MLflow Model Registry, with the checks of the evaluation metrics."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from components.config.rules import _require


@dataclass
class EvaluateConfig:
    """Held-out evaluation with greedy decoding."""

    max_new_tokens: int = 6
    """Greedy decoding budget per prompt."""
    batch_size: int = 250
    """Prompts decoded at once."""
    bootstrap_samples: int = 10000
    """Resamples for the paired 95% bootstrap interval."""
    metrics: list[str] = field(default_factory=lambda: ["reward", "pass@4", "completion_length", "eos_rate"])
    """Task metrics on held-out completions, each for baseline and candidate with a paired 95% CI
    (components/engine/evaluation/task_metrics.py): `reward` (the training reward's weighted sum, always computed),
    a reward's name (a built-in or `module:function`, scored alone), `pass@k` (share of prompts with a
    correct completion among k samples at `pass_k_temperature`; unbiased estimator), `completion_length`
    (tokens) and `eos_rate` (share of completions that end with EOS within `max_new_tokens`)."""
    pass_k_temperature: float = 1.0
    """Sampling temperature of the pass@k completions."""
    pass_k_top_p: float = 1.0
    """Nucleus threshold of the pass@k completions."""
    pass_k_top_k: int = 0
    """Top-k of the pass@k completions (0 = all tokens)."""
    pass_k_samples: int = 0
    """Completions sampled per prompt for pass@k (0 = k); more lowers the estimator's variance."""
    correct_at: float = 1.0
    """A sampled completion counts as correct for pass@k when its training reward total is >= this."""
    every: int = 200
    """GRPO steps between held-out evaluations during training (0 = off): greedy metrics on
    `during_training_n` held-out prompts, logged as MLflow curves (`heldout/...`) and as one MLflow
    LoggedModel per evaluated step; also at the last step."""
    during_training_n: int = 200
    """Held-out prompts (the first N, always the same) scored during training."""


@dataclass
class RegisterConfig:
    """MLflow Model Registry."""

    model_name: str = "grpo-addition"
    """Registered model name."""
    min_ci_low: float = 0.0
    """A challenger replaces the champion only if the CI lower bound of its improvement exceeds this."""
    gate_metric: str = "reward"
    """The held-out metric (one of `evaluate.metrics`, or `reward`) compared with the champion's."""
    require_improvement: bool = True
    """With no champion yet, the first version becomes champion only when it beats the model GRPO started from (the
    baseline this run evaluated) on `gate_metric`: paired 95% CI low > 0. false: the first version is champion
    whatever it measured."""
    merge_lora: bool = False
    """With LoRA, register the base with the adapter merged in (a full copy) instead of the adapter alone,
    which is linked to its base (registered once as `<model_name>-base`)."""


# the rest: pass@k, or a reward's name
FIXED_METRICS = ("reward", "completion_length", "episode_length", "environment_tokens", "eos_rate")
PASS_AT_K = re.compile(r"pass@([1-9][0-9]*)")


def greedy_metrics(e: EvaluateConfig) -> set[str]:
    """The metrics scored on greedy completions (all but pass@k): what `grpo.keep_metric` may name."""
    return set(FIXED_METRICS) | {n for n in e.metrics if not PASS_AT_K.fullmatch(n)}


def check_evaluate(e: EvaluateConfig) -> None:
    """evaluate: decoding budgets, the bootstrap, the metric names and pass@k's sampling."""
    _require(e.max_new_tokens >= 1, "evaluate.max_new_tokens", "must be >= 1")
    _require(e.batch_size >= 1, "evaluate.batch_size", "must be >= 1")
    _require(e.bootstrap_samples >= 100, "evaluate.bootstrap_samples", "must be >= 100")
    _require(len(e.metrics) >= 1, "evaluate.metrics", "needs at least one metric")
    _require(len(set(e.metrics)) == len(e.metrics), "evaluate.metrics", "lists a metric twice")
    for i, name in enumerate(e.metrics):
        _require(name in FIXED_METRICS or PASS_AT_K.fullmatch(name) is not None or ":" in name
                 or re.fullmatch(r"[a-z_]+", name) is not None, f"evaluate.metrics[{i}]",
                 f"{name!r} is not reward, completion_length, eos_rate, pass@k (k >= 1), a built-in reward's name "
                 "or package.module:function")
    ks = [int(PASS_AT_K.fullmatch(n).group(1)) for n in e.metrics if PASS_AT_K.fullmatch(n)]
    _require(e.pass_k_samples == 0 or e.pass_k_samples >= max(ks, default=1), "evaluate.pass_k_samples",
             f"must be 0 (= k) or >= the largest k ({max(ks, default=1)})")
    _require(e.pass_k_temperature > 0, "evaluate.pass_k_temperature", "must be > 0")
    _require(0 < e.pass_k_top_p <= 1, "evaluate.pass_k_top_p", "must be in (0, 1]")
    _require(e.pass_k_top_k >= 0, "evaluate.pass_k_top_k", "must be >= 0 (0 = all tokens)")
    _require(e.every >= 0, "evaluate.every", "must be >= 0 (0 = no evaluation during training)")
    _require(e.during_training_n >= 1, "evaluate.during_training_n", "must be >= 1")


def check_register(r: RegisterConfig) -> None:
    """register: a model name (its gate metric is checked against evaluate.metrics in `validate_config`)."""
    _require(bool(r.model_name.strip()), "register.model_name", "must not be empty")
