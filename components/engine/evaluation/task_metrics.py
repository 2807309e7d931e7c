"""Task metrics on held-out completions, kept apart from the training reward (`evaluate.metrics`).

A metric gives one number per prompt, so baseline and candidate (or challenger and champion) can be
compared prompt by prompt with the paired bootstrap:

- `reward`: the training reward's weighted sum on the greedy completion;
- a reward's name (a built-in or `package.module:function`): that reward alone (weight 1; the options
  of the training reward of the same name, if there is one);
- `pass@k`: whether a correct completion (training reward total >= `evaluate.correct_at`) is among k
  sampled at `evaluate.pass_k_temperature`, with Chen et al.'s unbiased estimator over n >= k samples;
- `completion_length`: tokens the model wrote in the greedy completion, EOS included (in an episode, every model
  turn's), as the step metric of the same name counts them;
- `episode_length`: every token after the prompt (the model's and a tool's or environment's); `environment_tokens`:
  those a tool or the environment wrote (0 for single turns);
- `eos_rate`: 1 when the greedy completion ended with EOS within `evaluate.max_new_tokens`, else 0 (an episode:
  when it ended without meeting a limit).

Completions come from the one generation service (`generation.service.for_evaluation`), played the same way
as in training with `evaluate.max_new_tokens` tokens after each prompt; rewards read them as in training.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from math import comb
from typing import Any

import torch

from components.config import FIXED_METRICS, PASS_AT_K, ConfigError, EvaluateConfig, PipelineConfig, RewardSpec
from components.engine.generation.engines.base import SamplingParams
from components.engine.generation.scoring import Completions, score
from components.engine.generation.service import Generation, for_evaluation
from components.engine.rewards.rewards import RewardModel, resolve_reward


def pass_at_k(n: int, correct: int, k: int) -> float:
    """Probability that k of n samples (`correct` of them correct), drawn without replacement, hold a correct
    one: 1 - C(n - c, k) / C(n, k) (Chen et al. 2021, "Evaluating Large Language Models Trained on Code")."""
    if not 0 <= correct <= n or not 1 <= k <= n:
        raise ValueError(f"pass@{k} needs 1 <= k <= n and 0 <= correct <= n (n={n}, correct={correct})")
    if n - correct < k:
        return 1.0
    return 1.0 - comb(n - correct, k) / comb(n, k)


def pass_k(name: str) -> int | None:
    """k of a `pass@k` metric name, else None."""
    match = PASS_AT_K.fullmatch(name)
    return int(match.group(1)) if match else None


def metric_key(name: str) -> str:
    """A metric name MLflow accepts: `pass@4` -> `pass_at_4`, `my.rewards:f` -> `my.rewards.f`."""
    return re.sub(r"[^\w./ -]", "_", name.replace("@", "_at_").replace(":", "."))


def check_metrics(names: Sequence[str]) -> None:
    """Every reward-named metric resolves (imports the user's module, so not part of config validation)."""
    for i, name in enumerate(names):
        if name in FIXED_METRICS or pass_k(name):
            continue
        try:
            resolve_reward(name)
        except (KeyError, ImportError, AttributeError, ValueError) as err:
            raise ConfigError(f"evaluate.metrics[{i}]: {err}") from err


@torch.no_grad()
def generate(generation: Generation, model, records: Sequence[dict[str, Any]], params: SamplingParams,
             batch_size: int, generator: torch.Generator | None = None) -> Completions:
    """`params.n` completions of each record, `batch_size` records at a time, with `model` in eval mode."""
    was_training = model.training
    model.eval()
    out = Completions()
    try:
        for start in range(0, len(records), batch_size):
            rollouts = generation.run(records[start: start + batch_size], params, generator)
            out.extend(Completions.of(rollouts, generation.read(rollouts)))
    finally:
        model.train(was_training)
    return out


class TaskMetrics:
    """Computes `evaluate.metrics` (plus `reward`, always) per prompt for one model."""

    def __init__(self, e: EvaluateConfig, rewards: Sequence[RewardSpec], names: Sequence[str] | None = None,
                 timeout_s: float = 0.0, cfg: PipelineConfig | None = None):
        """`timeout_s`: each reward call's time limit (0 = none); evaluation during training uses GRPO's.
        `cfg`: the run's prompt settings, tools or environment (how completions are generated; default: single turns
        of the record's prompt)."""
        self.e, self.cfg = e, cfg if cfg is not None else PipelineConfig()
        self.names = list(dict.fromkeys(["reward", *(e.metrics if names is None else names)]))
        self.reward = RewardModel(rewards, timeout_s=timeout_s)
        options = {spec.name: spec.options for spec in rewards}
        self.single = {name: RewardModel([RewardSpec(name=name, weight=1.0, options=dict(options.get(name, {})))],
                                         timeout_s=timeout_s)
                       for name in self.names if name not in FIXED_METRICS and not pass_k(name)}

    @property
    def greedy_names(self) -> list[str]:
        return [n for n in self.names if not pass_k(n)]

    def per_prompt(self, model, tokenizer, records: list[dict[str, Any]], seed: int,
                   greedy_only: bool = False) -> tuple[dict[str, list[float]], Completions]:
        """{metric: one value per record} and the greedy completions; pass@k left out when `greedy_only`."""
        e = self.e
        generation = for_evaluation(self.cfg, model, tokenizer, e.max_new_tokens, records)
        out = generate(generation, model, records, SamplingParams(max_new_tokens=e.max_new_tokens, greedy=True),
                       e.batch_size)
        values: dict[str, list[float]] = {"reward": score(self.reward, records, out).total}
        fixed = {"completion_length": out.lengths, "episode_length": out.episode_lengths,
                 "environment_tokens": [a - b for a, b in zip(out.episode_lengths, out.lengths)], "eos_rate": out.ended}
        for name in self.greedy_names:
            if name in fixed:
                values[name] = [float(x) for x in fixed[name]]
            elif name in self.single:
                values[name] = score(self.single[name], records, out).total
        ks = [k for k in map(pass_k, self.names) if k]
        if ks and not greedy_only:
            n = e.pass_k_samples or max(ks)
            generator = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
            params = SamplingParams(n=n, max_new_tokens=e.max_new_tokens, temperature=e.pass_k_temperature,
                                    top_p=e.pass_k_top_p, top_k=e.pass_k_top_k)
            sampled = generate(generation, model, records, params, max(1, e.batch_size // n), generator)
            scores = score(self.reward, records, sampled, per_record=n).total
            correct = (torch.tensor(scores).view(-1, n) >= e.correct_at).sum(1).tolist()  # per record's group
            for k in ks:
                values[f"pass@{k}"] = [pass_at_k(n, c, k) for c in correct]
        return {name: values[name] for name in self.names if name in values}, out
