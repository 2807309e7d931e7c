"""Task metrics on held-out completions, kept apart from the training reward (`evaluate.metrics`).

A metric gives one number per prompt, so baseline and candidate (or challenger and champion) can be
compared prompt by prompt with the paired bootstrap:

- `reward`: the training reward's weighted sum on the greedy completion;
- a reward's name (a built-in or `package.module:function`): that reward alone (weight 1; the options
  of the training reward of the same name, if there is one);
- `pass@k`: whether a correct completion (training reward total >= `evaluate.correct_at`) is among k
  sampled at `evaluate.pass_k_temperature`, with Chen et al.'s unbiased estimator over n >= k samples;
- `completion_length`: tokens of the greedy completion, EOS included (in an episode, every model turn's);
- `eos_rate`: 1 when the greedy completion ended with EOS within `evaluate.max_new_tokens`, else 0 (an episode:
  when it ended without meeting a limit).

With tools or an environment (`grpo.tools`, `grpo.environment`) every completion is an episode, played the same way
as in training with `evaluate.max_new_tokens` tokens after each prompt; rewards read it as in training.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from math import comb
from typing import Any

import torch

from components.config import FIXED_METRICS, PASS_AT_K, ConfigError, EvaluateConfig, RewardSpec
from components.data.records import reward_columns
from components.engine.environments.episodes import reward_inputs, transcript
from components.engine.environments.spec import EpisodeSpec
from components.engine.rewards.rewards import RewardModel, resolve_reward
from components.engine.rollout.base import SamplingParams
from components.engine.rollout.choose import evaluation_engine
from components.engine.rollout.hf import sample_texts


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


@dataclass
class Completions:
    """Decoded completions with their token lengths and whether each ended with EOS (prompt-major); for episodes,
    the columns rewards read about them and each episode's transcript."""

    texts: list[str]
    lengths: list[int]
    ended: list[bool]
    columns: dict[str, list[Any]] = field(default_factory=dict)
    transcripts: list[str] | None = None


@torch.no_grad()
def generate(model, tokenizer, prompts: list[str], n: int, max_new_tokens: int, batch_size: int, *,
             greedy: bool = True, temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0,
             generator: torch.Generator | None = None, episodes: EpisodeSpec | None = None,
             records: Sequence[dict[str, Any]] = ()) -> Completions:
    """n completions per prompt (greedy: n = 1), `batch_size` prompts at a time, in eval mode; with `episodes`, n
    episodes of each of `records` instead (the prompts are then the environments' first messages)."""
    params = SamplingParams(n=n, max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
                            greedy=greedy)
    runner = episodes.runner(tokenizer, max_new_tokens) if episodes is not None else None
    was_training = model.training
    model.eval()
    engine = evaluation_engine(model, tokenizer, max_new_tokens, runner.longest_row(records)) \
        if runner is not None else None
    out = Completions([], [], [], {}, [] if runner is not None else None)
    try:
        for start in range(0, len(prompts), batch_size):
            if runner is not None:
                rollouts = runner.run(engine, records[start: start + batch_size], params, generator)
            else:
                rollouts = sample_texts(model, tokenizer, prompts[start: start + batch_size], params, generator)
            texts, columns = reward_inputs(tokenizer, rollouts)
            out.texts += texts
            for key, values in columns.items():
                out.columns.setdefault(key, []).extend(values)
            if out.transcripts is not None:
                out.transcripts += [transcript(e) for e in rollouts.episodes]
            out.lengths += rollouts.completion_lengths()
            out.ended += [bool(x) for x in ~rollouts.truncated]
    finally:
        model.train(was_training)
    return out


class TaskMetrics:
    """Computes `evaluate.metrics` (plus `reward`, always) per prompt for one model."""

    def __init__(self, e: EvaluateConfig, rewards: Sequence[RewardSpec], names: Sequence[str] | None = None,
                 timeout_s: float = 0.0, episodes: EpisodeSpec | None = None):
        """`timeout_s`: each reward call's time limit (0 = none); evaluation during training uses GRPO's.
        `episodes`: the run's tools or environment (`environments.spec.episode_spec`), None for single turns."""
        self.e, self.episodes = e, episodes
        self.names = list(dict.fromkeys(["reward", *(e.metrics if names is None else names)]))
        self.reward = RewardModel(rewards, timeout_s=timeout_s)
        options = {spec.name: spec.options for spec in rewards}
        self.single = {name: RewardModel([RewardSpec(name=name, weight=1.0, options=dict(options.get(name, {})))],
                                         timeout_s=timeout_s)
                       for name in self.names if name not in FIXED_METRICS and not pass_k(name)}

    @property
    def greedy_names(self) -> list[str]:
        return [n for n in self.names if not pass_k(n)]

    def per_prompt(self, model, tokenizer, prompts: list[str], records: list[dict[str, Any]], seed: int,
                   greedy_only: bool = False) -> tuple[dict[str, list[float]], Completions]:
        """{metric: one value per prompt} and the greedy completions; pass@k left out when `greedy_only`."""
        e = self.e
        out = generate(model, tokenizer, prompts, 1, e.max_new_tokens, e.batch_size, episodes=self.episodes,
                       records=records)
        columns = {**reward_columns(records, 1), **out.columns}
        values: dict[str, list[float]] = {"reward": self.reward(prompts, out.texts, columns).total}
        for name in self.greedy_names:
            if name == "completion_length":
                values[name] = [float(x) for x in out.lengths]
            elif name == "eos_rate":
                values[name] = [float(x) for x in out.ended]
            elif name in self.single:
                values[name] = self.single[name](prompts, out.texts, columns).total
        ks = [k for k in map(pass_k, self.names) if k]
        if ks and not greedy_only:
            n = e.pass_k_samples or max(ks)
            generator = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
            sampled = generate(model, tokenizer, prompts, n, e.max_new_tokens, max(1, e.batch_size // n),
                               greedy=False, temperature=e.pass_k_temperature, top_p=e.pass_k_top_p,
                               top_k=e.pass_k_top_k, generator=generator, episodes=self.episodes, records=records)
            scores = self.reward([p for p in prompts for _ in range(n)], sampled.texts,
                                 {**reward_columns(records, n), **sampled.columns}).total
            correct = [sum(s >= e.correct_at for s in scores[i * n:(i + 1) * n]) for i in range(len(prompts))]
            for k in ks:
                values[f"pass@{k}"] = [pass_at_k(n, c, k) for c in correct]
        return {name: values[name] for name in self.names if name in values}, out
