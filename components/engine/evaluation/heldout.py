"""Held-out evaluation: greedy completions, their rewards, the paired bootstrap, and the held-out reward of
one model directory or training checkpoint (for evaluating many at once).

Accepts an HF model directory (models/sft, models/grpo, a pointer) or a GRPO training checkpoint
(checkpoints/grpo/step-N: safetensors weights without config or tokenizer, loaded into the start
model's architecture). One call is self-contained, so a task runner can run several in parallel.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from components.config import PipelineConfig
from components.data.checkpoints import TRAINABLE_FILE
from components.data.paths import Paths
from components.data.records import file_md5, read_jsonl, split_path
from components.engine.generation.engines.base import SamplingParams
from components.engine.generation.scoring import Completions, score
from components.engine.generation.service import for_evaluation
from components.engine.models.modeling import (
    ModelLoadError,
    load_policy_model,
    load_tokenizer,
    pick_device,
    resolve_model_dir,
    seed_everything,
)
from components.engine.rewards.rewards import RewardModel


def paired_bootstrap(candidate: np.ndarray, baseline: np.ndarray, samples: int, seed: int) -> dict[str, float]:
    """Mean paired difference and its 95% percentile-bootstrap interval (prompts resampled)."""
    diffs = np.asarray(candidate, dtype=float) - np.asarray(baseline, dtype=float)
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, len(diffs), size=(samples, len(diffs)))
    means = diffs[idx].mean(axis=1)
    low, high = np.percentile(means, [2.5, 97.5])
    return {"mean": float(diffs.mean()), "ci95_low": float(low), "ci95_high": float(high)}


def greedy_completions_of(cfg: PipelineConfig, model, tokenizer, records: list[dict[str, Any]]) -> Completions:
    """Greedy completions of an in-memory model as rewards read them (benchmarks evaluate mid-training without
    saving; score them with `scoring.score`), `evaluate.max_new_tokens` and `evaluate.batch_size` as the evaluate
    stage."""
    from components.engine.evaluation.task_metrics import generate

    e = cfg.evaluate
    generation = for_evaluation(cfg, model, tokenizer, e.max_new_tokens, records)
    return generate(generation, model, records, SamplingParams(max_new_tokens=e.max_new_tokens, greedy=True),
                    e.batch_size)


def is_training_checkpoint(path: Path) -> bool:
    weights = (path / "model.safetensors").exists() or (path / TRAINABLE_FILE).exists()
    return weights and (path / "meta.json").exists() and not (path / "config.json").exists()


def load_for_eval(cfg: PipelineConfig, path: Path, paths: Paths, device):
    """(tokenizer, model) for an HF directory or a training checkpoint (start model + its weights)."""
    if not path.exists():
        raise ModelLoadError(f"{path}: no such model directory or checkpoint")
    if not is_training_checkpoint(path):
        return load_tokenizer(path, cfg.model.trust_remote_code), load_policy_model(cfg, path, device)
    from safetensors.torch import load_model

    if (path / TRAINABLE_FILE).exists():
        raise ModelLoadError(f"{path}: a LoRA training checkpoint holds only the adapter's optimizer state; "
                             "evaluate models/grpo (the base model plus the final adapter)")
    start = resolve_model_dir(paths.sft_model)
    model = load_policy_model(cfg, start, device)
    try:
        load_model(model, str(path / "model.safetensors"))
    except RuntimeError as err:
        raise ModelLoadError(f"{path}: weights do not fit the start model {start} (a LoRA checkpoint? evaluate "
                             f"models/grpo, where the adapters are merged): {str(err)[:200]}") from err
    return load_tokenizer(start, cfg.model.trust_remote_code), model.eval()


def score_checkpoint(cfg: PipelineConfig, path: Path, paths: Paths = Paths()) -> dict[str, Any]:
    """Mean greedy reward on the held-out split, with per-prompt completions and rewards."""
    e = cfg.evaluate
    seed_everything(cfg.seed, cfg.threads)
    device = pick_device(cfg.device)
    tokenizer, model = load_for_eval(cfg, Path(path), paths, device)
    heldout = split_path(paths.data, "heldout")
    records = read_jsonl(heldout)
    from components.engine.evaluation.task_metrics import generate

    generation = for_evaluation(cfg, model, tokenizer, e.max_new_tokens, records)
    out = generate(generation, model, records, SamplingParams(max_new_tokens=e.max_new_tokens, greedy=True),
                   e.batch_size)
    rewards = score(RewardModel(cfg.grpo.rewards), records, out).total
    return {"checkpoint": str(path), "n": len(records), "heldout_md5": file_md5(heldout),
            "mean_reward": float(np.mean(rewards)), "rewards": rewards, "completions": out.transcripts}


class HeldoutProbe:
    """Greedy held-out metrics of the policy while it trains (`evaluate.every`), on the first
    `evaluate.during_training_n` held-out prompts: the same prompts every time, so the curve shows the
    model changing, not the sample. Greedy decoding draws no random numbers, so training is unchanged.

    Its origin is the model GRPO starts from (evaluated before step 1): every later evaluation also
    reports the paired change of `grpo.keep_metric` over it and that change's standard error, the
    evidence the `heldout_flat` monitor reads."""

    def __init__(self, cfg: PipelineConfig, paths: Paths, tokenizer):
        from components.engine.evaluation.task_metrics import TaskMetrics

        e = cfg.evaluate
        self.every, self.steps, self.tokenizer = e.every, cfg.grpo.steps, tokenizer
        self.keep_metric = cfg.grpo.keep_metric
        self.records = read_jsonl(split_path(paths.data, "heldout"))[: e.during_training_n]
        # pass@k is skipped below; a reward that hangs is stopped as in a training step
        self.metrics = TaskMetrics(e, cfg.grpo.rewards, [*e.metrics, cfg.grpo.keep_metric], cfg.grpo.reward_timeout_s,
                                   cfg)
        self.seconds = 0.0
        self.origin: np.ndarray | None = None  # the start model's per-prompt keep_metric
        self.origin_scores: dict[str, float] = {}

    def due(self, step: int) -> bool:
        return self.every > 0 and (step % self.every == 0 or step == self.steps)

    def set_origin(self, model) -> dict[str, float]:
        """Evaluate the model GRPO starts from: the curve's step 0 and the reference of every later change."""
        values = self._per_prompt(model)
        self.origin = np.asarray(values[self.keep_metric], dtype=float)
        self.origin_scores = {name: float(np.mean(v)) for name, v in values.items()}
        return self.origin_scores

    def __call__(self, model) -> dict[str, float]:
        """Each metric's mean over the subset, and (once the origin is known) `<keep_metric>_vs_start`, the
        paired mean change over the start model, with its standard error `<keep_metric>_vs_start_se`."""
        values = self._per_prompt(model)
        scores = {name: float(np.mean(v)) for name, v in values.items()}
        if self.origin is not None:
            change = np.asarray(values[self.keep_metric], dtype=float) - self.origin
            se = float(change.std(ddof=1) / np.sqrt(len(change))) if len(change) > 1 else 0.0
            scores.update({f"{self.keep_metric}_vs_start": float(change.mean()),
                           f"{self.keep_metric}_vs_start_se": se})
        return scores

    def _per_prompt(self, model) -> dict[str, list[float]]:
        import time

        started = time.perf_counter()
        values, _ = self.metrics.per_prompt(model, self.tokenizer, self.records, seed=0, greedy_only=True)
        self.seconds += time.perf_counter() - started
        return values
