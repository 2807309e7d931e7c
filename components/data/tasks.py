"""Built-in procedural tasks: verifiable problems a tiny model can learn on two CPU cores."""

from __future__ import annotations

import random
from typing import Any

from components.config import TaskConfig


def addition_problems(task: TaskConfig, seed: int, style: str = "{a}+{b}=") -> dict[str, list[dict[str, Any]]]:
    """Disjoint sft / train / heldout splits of "a+b=" -> "a+b" problems, drawn without replacement."""
    lo, hi = task.min_operand, task.max_operand
    pairs = [(a, b) for a in range(lo, hi + 1) for b in range(lo, hi + 1)]
    rng = random.Random(seed)
    rng.shuffle(pairs)
    sizes = {"sft": task.n_sft, "train": task.n_train, "heldout": task.n_heldout}
    splits: dict[str, list[dict[str, Any]]] = {}
    start = 0
    for split, size in sizes.items():
        chosen = pairs[start: start + size]
        start += size
        splits[split] = [{"id": f"{split}-{i:06d}", "prompt": style.format(a=a, b=b), "answer": str(a + b)}
                         for i, (a, b) in enumerate(chosen)]
    return splits


def addition_questions(task: TaskConfig, seed: int) -> dict[str, list[dict[str, Any]]]:
    """The same problems asked in words ("What is 12 + 7?" -> "19"), for instruct models with a chat template."""
    return addition_problems(task, seed, style="What is {a} + {b}?")


TASKS = {"addition": addition_problems, "addition_question": addition_questions}
