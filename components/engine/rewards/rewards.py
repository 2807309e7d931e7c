"""Reward functions: built-ins by name or any `package.module:function`, combined by weight.

A reward is `(prompts, completions, **columns) -> list[float | None]`, the same contract as TRL's,
so users bring theirs unchanged. `None` means "not applicable": it is left out of that component's
mean and counts 0 in the weighted sum.
"""

from __future__ import annotations

import functools
import importlib.util
import logging
import math
import re
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from components.config import ConfigError, RewardSpec
from components.engine.rewards.extract import extract_answer
from components.user_code import UserCodeError, calling, load_callable

LOG = logging.getLogger(__name__)

RewardFn = Callable[..., list]


def exact_match(prompts: Sequence[str], completions: Sequence[str], answer: Sequence[Any], extract: str | None = None,
                **_: Any) -> list[float | None]:
    """`1.0` when the completion (text before EOS; or its `extract`ed answer) equals the answer, whitespace aside."""
    scores: list[float | None] = []
    for c, a in zip(completions, answer):
        got = extract_answer(c, extract)
        scores.append(None if a is None else float(got is not None and got.strip() == str(a).strip()))
    return scores


_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def numeric_match(prompts: Sequence[str], completions: Sequence[str], answer: Sequence[Any],
                  tolerance: float = 1e-6, extract: str | None = None, **_: Any) -> list[float | None]:
    """`1.0` when the first number of the completion (or of its `extract`ed answer) equals the answer within
    `tolerance`."""
    scores: list[float | None] = []
    for c, a in zip(completions, answer):
        if a is None:
            scores.append(None)
            continue
        got = extract_answer(c, extract)
        found = _NUMBER.search(got.replace(",", "")) if got is not None else None
        try:
            scores.append(float(found is not None
                                and abs(float(found.group()) - float(str(a).replace(",", ""))) <= tolerance))
        except ValueError:
            scores.append(0.0)
    return scores


def math_verify(prompts: Sequence[str], completions: Sequence[str], answer: Sequence[Any], extract: str | None = None,
                **_: Any) -> list[float | None]:
    """`1.0` when math-verify finds the (extracted) completion numerically or symbolically equal to the answer."""
    from math_verify import parse, verify

    scores: list[float | None] = []
    for c, a in zip(completions, answer):
        if a is None:
            scores.append(None)
            continue
        got = extract_answer(c, extract) if extract else c
        if got is None:
            scores.append(0.0)
            continue
        gold = parse(f"${a}$") or parse(str(a))
        pred = parse(f"${got}$") if extract else parse(got)
        scores.append(float(bool(gold) and bool(pred) and verify(gold, pred)))
    return scores


def regex_format(prompts: Sequence[str], completions: Sequence[str], pattern: str = r".+", mode: str = "fullmatch",
                 **_: Any) -> list[float | None]:
    """`1.0` when the completion matches `pattern` (`fullmatch` on the stripped text, or `search`)."""
    rx = re.compile(pattern, re.DOTALL)
    match = rx.fullmatch if mode == "fullmatch" else rx.search
    return [float(match(c.strip() if mode == "fullmatch" else c) is not None) for c in completions]


def _tokens(text: Any) -> list[str]:
    return str(text).lower().split()


def _f1(candidate: list[str], reference: list[str]) -> float:
    common = sum((Counter(candidate) & Counter(reference)).values())
    if not candidate or not reference or common == 0:
        return float(candidate == reference)
    precision, recall = common / len(candidate), common / len(reference)
    return 2 * precision * recall / (precision + recall)


def _lcs(a: list[str], b: list[str]) -> int:
    row = [0] * (len(b) + 1)
    for x in a:
        prev = 0
        for j, y in enumerate(b, start=1):
            prev, row[j] = row[j], prev + 1 if x == y else max(row[j], row[j - 1])
    return row[-1]


def _rouge_l(candidate: list[str], reference: list[str]) -> float:
    if not candidate or not reference:
        return float(candidate == reference)
    lcs = _lcs(candidate, reference)
    if lcs == 0:
        return 0.0
    precision, recall = lcs / len(candidate), lcs / len(reference)
    return 2 * precision * recall / (precision + recall)


def _bleu(candidate: list[str], reference: list[str], max_n: int = 4) -> float:
    """Sentence BLEU with add-one smoothing for n > 1 (Lin & Och 2004) and the brevity penalty."""
    if not candidate or not reference:
        return float(candidate == reference)
    log_sum, orders = 0.0, min(max_n, len(candidate))
    for n in range(1, orders + 1):
        cand = Counter(tuple(candidate[i:i + n]) for i in range(len(candidate) - n + 1))
        ref = Counter(tuple(reference[i:i + n]) for i in range(len(reference) - n + 1))
        overlap, total = sum((cand & ref).values()), sum(cand.values())
        if n == 1 and overlap == 0:
            return 0.0
        smooth = 0 if n == 1 else 1
        log_sum += math.log((overlap + smooth) / (total + smooth))
    brevity = min(0.0, 1.0 - len(reference) / len(candidate))
    return math.exp(brevity + log_sum / orders)


def _against_answer(metric: Callable[[list[str], list[str]], float]) -> RewardFn:
    def reward(prompts: Sequence[str], completions: Sequence[str], answer: Sequence[Any], **_: Any):
        return [None if a is None else metric(_tokens(c), _tokens(a)) for c, a in zip(completions, answer)]
    reward.__doc__ = f"{metric.__name__.strip('_')} of the completion against the reference answer (whitespace tokens)."
    return reward


token_f1 = _against_answer(_f1)
rouge_l = _against_answer(_rouge_l)
bleu = _against_answer(_bleu)
f1rougebleu = _against_answer(lambda c, r: (_f1(c, r) + _rouge_l(c, r) + _bleu(c, r)) / 3)


def _ngrams(tokens: list[str], n: int) -> set[tuple[str, ...]]:
    """The distinct n-grams of `tokens`; a text shorter than n is one n-gram of its own."""
    if len(tokens) < n:
        return {tuple(tokens)} if tokens else set()
    return {tuple(tokens[i:i + n]) for i in range(len(tokens) - n + 1)}


def distinct_ngrams(prompts: Sequence[str], completions: Sequence[str], n: int = 2,
                    group_index: Sequence[int] | None = None, **_: Any) -> list[float | None]:
    """Diversity within a group: the share of a completion's distinct word
    n-grams that no other completion of its group contains. 1 for a completion unlike the rest, 0 for a copy or an
    empty one; None (not applicable) for a completion alone in its group, as in a greedy evaluation. Groups are
    GRPO's sampled groups (`group_index`, which training passes), else the completions of the same prompt."""
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    grams = [_ngrams(_tokens(c), n) for c in completions]
    keys = list(group_index) if group_index is not None else list(prompts)
    groups: dict[Any, list[int]] = {}
    for i, key in enumerate(keys):
        groups.setdefault(key, []).append(i)
    scores: list[float | None] = [None] * len(completions)
    for rows in groups.values():
        if len(rows) < 2:
            continue
        counts = Counter(gram for i in rows for gram in grams[i])
        for i in rows:
            scores[i] = sum(counts[gram] == 1 for gram in grams[i]) / len(grams[i]) if grams[i] else 0.0
    return scores


def length_penalty(prompts: Sequence[str], completions: Sequence[str], max_chars: int = 200,
                   **_: Any) -> list[float | None]:
    """0 up to `max_chars`, then minus the overshoot as a fraction of `max_chars`."""
    return [-max(0, len(c) - max_chars) / max_chars for c in completions]


def overlong_penalty(prompts: Sequence[str], completions: Sequence[str], completion_token_lengths: Sequence[int] = (),
                     max_length: int = 512, buffer: int = 64, penalty: float = 1.0, **_: Any) -> list[float | None]:
    """DAPO soft overlong punishment on token lengths: 0, then a linear ramp to -penalty over the buffer."""
    out: list[float | None] = []
    for length in completion_token_lengths:
        if length <= max_length - buffer:
            out.append(0.0)
        elif length <= max_length:
            out.append((max_length - buffer - length) / buffer * penalty)
        else:
            out.append(-penalty)
    return out


def code_execution(prompts: Sequence[str], completions: Sequence[str], tests: Sequence[Any] = (),
                   timeout_s: float = 5.0, memory_mb: int = 512, allow_hook_only: bool = False,
                   **_: Any) -> list[float | None]:
    """`1.0` when the completion, followed by the record's `tests` code, exits 0 in the sandbox. The sandbox needs
    the kernel's confinement (docs/security.md); `allow_hook_only: true` accepts the audit hook alone where the
    kernel has none (macOS, before Linux 5.13)."""
    from components.engine.rewards.sandbox import run_untrusted_python

    scores: list[float | None] = []
    for completion, test in zip(completions, tests or [None] * len(completions)):
        if test is None:
            scores.append(None)
            continue
        result = run_untrusted_python(f"{completion}\n\n{test}", timeout_s=timeout_s, memory_mb=memory_mb,
                                      require_kernel=not allow_hook_only)
        if not result.passed:
            LOG.info("code_execution: scored 0 (%s)", result.reason)
        scores.append(float(result.passed))
    return scores


@functools.lru_cache(maxsize=4)
def _load_judge(path: str):
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from components.engine.models.modeling import resolve_model_dir

    model_dir = str(resolve_model_dir(path))
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    model = AutoModelForSequenceClassification.from_pretrained(model_dir, use_safetensors=True).eval()
    model.requires_grad_(False)
    return tokenizer, model, torch


def judge_model(prompts: Sequence[str], completions: Sequence[str], path: str = "", batch_size: int = 32,
                label_index: int = -1, **_: Any) -> list[float | None]:
    """A frozen sequence classifier's score of prompt + completion: P(label) or the single logit."""
    if not path:
        raise ValueError("judge_model needs options.path: a local AutoModelForSequenceClassification directory")
    tokenizer, model, torch = _load_judge(path)
    scores: list[float | None] = []
    with torch.inference_mode():
        for start in range(0, len(completions), batch_size):
            texts = [p + c for p, c in zip(prompts[start:start + batch_size], completions[start:start + batch_size])]
            logits = model(**tokenizer(texts, return_tensors="pt", padding=True, truncation=True)).logits.float()
            if logits.shape[-1] == 1:
                scores += logits[:, 0].tolist()
            else:
                scores += torch.softmax(logits, -1)[:, label_index].tolist()
    return scores


def environment_reward(prompts: Sequence[str], completions: Sequence[str],
                       environment_reward: Sequence[float | None] | None = None, **_: Any) -> list[float | None]:
    """The reward an environment gave its episode (`grpo.environment`); None where it gave none, or where rollouts
    are no episodes."""
    if environment_reward is None:
        return [None] * len(completions)
    return [None if r is None else float(r) for r in environment_reward]


BUILTIN_REWARDS: dict[str, RewardFn] = {
    "exact_match": exact_match, "numeric_match": numeric_match, "regex_format": regex_format,
    "token_f1": token_f1, "rouge_l": rouge_l, "bleu": bleu, "f1rougebleu": f1rougebleu,
    "length_penalty": length_penalty, "overlong_penalty": overlong_penalty, "code_execution": code_execution,
    "distinct_ngrams": distinct_ngrams, "environment_reward": environment_reward,
    "judge_model": judge_model, "math_verify": math_verify,
}
OPTIONAL_PACKAGES = {"math_verify": ("math_verify", "pip install -c constraints.txt -e '.[math]'")}


def resolve_reward(name: str) -> RewardFn:
    """A built-in by name, or `package.module:function` imported from the user's code."""
    if name in BUILTIN_REWARDS:
        if name in OPTIONAL_PACKAGES:
            module, hint = OPTIONAL_PACKAGES[name]
            if importlib.util.find_spec(module) is None:
                raise ImportError(f"reward {name!r} needs the {module} package: {hint}")
        return BUILTIN_REWARDS[name]
    return load_callable(name, BUILTIN_REWARDS, "reward")


def check_rewards(specs: Sequence[RewardSpec]) -> None:
    """Every configured reward resolves (a built-in, or `module:function` the user's code provides).

    Not part of config validation: resolving imports the user's reward modules, and the config layer
    imports nothing of the engine. The stage CLI and the pipeline's pre-flight call it.
    """
    for i, spec in enumerate(specs):
        try:
            resolve_reward(spec.name)
        except (KeyError, ImportError, AttributeError, ValueError) as err:
            raise ConfigError(f"grpo.rewards[{i}].name: {err}") from err
        if spec.name == "code_execution" and not dict(getattr(spec, "options", {})).get("allow_hook_only"):
            from components.engine.rewards.sandbox import kernel_confinement_problem

            if problem := kernel_confinement_problem():
                raise ConfigError(f"grpo.rewards[{i}]: code_execution runs model-written code, and this machine "
                                  f"cannot confine it: {problem}. Run on Linux 5.13 or newer with Landlock, or accept "
                                  "the audit hook alone with options: {allow_hook_only: true} (docs/security.md)")


class RewardError(UserCodeError):
    """A reward function misbehaved (raised anything, `SystemExit` included; wrong length, NaN/inf); names the
    reward."""


@dataclass
class RewardResult:
    """Weighted total per completion, and each component's raw scores (None = not applicable)."""

    total: list[float]
    components: dict[str, list[float | None]]
    scores: list[list[float | None]] = field(default_factory=list)  # per component, in config order
    weights: list[float] = field(default_factory=list)  # each component's weight, in the same order

    @property
    def scorable(self) -> list[bool]:
        """Per completion: did at least one reward score it (not None)?"""
        return [any(scores[i] is not None for scores in self.components.values()) for i in range(len(self.total))]

    def advantage_rewards(self) -> list[float]:
        """Totals with NaN where no reward scored the completion: GRPO leaves those out of its group's
        statistics, gives them advantage 0 and keeps them out of the loss (TRL does the same)."""
        return [total if ok else math.nan for total, ok in zip(self.total, self.scorable)]

    def component_means(self) -> dict[str, float]:
        means = {}
        for name, scores in self.components.items():
            valid = [s for s in scores if s is not None]
            means[name] = sum(valid) / len(valid) if valid else float("nan")
        return means


class RewardModel:
    """The weighted sum of named reward components, each call under a time limit."""

    def __init__(self, specs: Sequence[Any], timeout_s: float = 0.0):
        self.timeout_s = timeout_s
        self.components = [(spec.name, resolve_reward(spec.name), float(spec.weight),
                            dict(getattr(spec, "options", {})))
                           for spec in specs]

    def __call__(self, prompts: list[str], completions: list[str], columns: dict[str, list[Any]]) -> RewardResult:
        total = [0.0] * len(completions)
        per_component: dict[str, list[float | None]] = {}
        ordered: list[list[float | None]] = []
        for name, fn, weight, options in self.components:
            # One door for the user's code (components/user_code.py): named failures, a note while it runs.
            with calling(f"reward {name!r}", "scoring", RewardError, self.timeout_s):
                scores = list(fn(prompts, completions, **{**columns, **options}))
            if len(scores) != len(completions):
                raise RewardError(f"reward {name!r} returned {len(scores)} values for {len(completions)} completions")
            for i, score in enumerate(scores):
                if score is None:
                    continue
                if not math.isfinite(float(score)):
                    raise RewardError(f"reward {name!r} returned {score} for completion {i}")
                total[i] += weight * float(score)
            per_component[name] = [None if s is None else float(s) for s in scores]
            ordered.append(per_component[name])
        return RewardResult(total=total, components=per_component, scores=ordered,
                            weights=[weight for _, _, weight, _ in self.components])
