"""Reward functions: built-ins by name or any `package.module:function`, combined by weight.

A reward is `(prompts, completions, **columns) -> list[float | None]`, the same contract as TRL's,
so users bring theirs unchanged. `None` means "not applicable": it is left out of that component's
mean and counts 0 in the weighted sum.
"""

from __future__ import annotations

import importlib
import math
import re
from dataclasses import dataclass
from typing import Any, Callable, Sequence

RewardFn = Callable[..., list]


def exact_match(prompts: Sequence[str], completions: Sequence[str], answer: Sequence[Any], **_: Any) -> list[float | None]:
    """1.0 when the completion (text before EOS, outer whitespace ignored) equals the answer."""
    return [None if a is None else float(c.strip() == str(a).strip()) for c, a in zip(completions, answer)]


_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def numeric_match(prompts: Sequence[str], completions: Sequence[str], answer: Sequence[Any],
                  tolerance: float = 1e-6, **_: Any) -> list[float | None]:
    """1.0 when the first number in the completion equals the answer within `tolerance`."""
    scores: list[float | None] = []
    for c, a in zip(completions, answer):
        if a is None:
            scores.append(None)
            continue
        found = _NUMBER.search(c)
        try:
            scores.append(float(found is not None and abs(float(found.group()) - float(a)) <= tolerance))
        except ValueError:
            scores.append(0.0)
    return scores


BUILTIN_REWARDS: dict[str, RewardFn] = {"exact_match": exact_match, "numeric_match": numeric_match}


def resolve_reward(name: str) -> RewardFn:
    """A built-in by name, or `package.module:function` imported from the user's code."""
    if name in BUILTIN_REWARDS:
        return BUILTIN_REWARDS[name]
    if ":" not in name:
        raise KeyError(f"unknown reward {name!r}; built-ins are {sorted(BUILTIN_REWARDS)}, "
                       "or give package.module:function")
    module_name, attr = name.split(":", 1)
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise ImportError(f"cannot import module {module_name!r} for reward {name!r}: {err}") from err
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise AttributeError(f"{module_name!r} has no callable {attr!r} for reward {name!r}")
    return fn


class RewardError(RuntimeError):
    """A reward function misbehaved (raised, wrong length, NaN/inf); names the reward."""


@dataclass
class RewardResult:
    """Weighted total per completion, and each component's raw scores (None = not applicable)."""

    total: list[float]
    components: dict[str, list[float | None]]

    def component_means(self) -> dict[str, float]:
        means = {}
        for name, scores in self.components.items():
            valid = [s for s in scores if s is not None]
            means[name] = sum(valid) / len(valid) if valid else float("nan")
        return means


class RewardModel:
    """The weighted sum of named reward components."""

    def __init__(self, specs: Sequence[Any]):
        self.components = [(spec.name, resolve_reward(spec.name), float(spec.weight)) for spec in specs]

    def __call__(self, prompts: list[str], completions: list[str], columns: dict[str, list[Any]]) -> RewardResult:
        total = [0.0] * len(completions)
        per_component: dict[str, list[float | None]] = {}
        for name, fn, weight in self.components:
            try:
                scores = list(fn(prompts, completions, **columns))
            except Exception as err:  # noqa: BLE001 - user code; re-raised with the reward's name
                raise RewardError(f"reward {name!r} raised {type(err).__name__}: {err}") from err
            if len(scores) != len(completions):
                raise RewardError(f"reward {name!r} returned {len(scores)} values for {len(completions)} completions")
            for i, score in enumerate(scores):
                if score is None:
                    continue
                if not math.isfinite(float(score)):
                    raise RewardError(f"reward {name!r} returned {score} for completion {i}")
                total[i] += weight * float(score)
            per_component[name] = [None if s is None else float(s) for s in scores]
        return RewardResult(total=total, components=per_component)
