"""Built-in procedural tasks: verifiable problems a tiny model can learn on two CPU cores."""

from __future__ import annotations

import random
from typing import Any

from components.config import TaskConfig


def addition_problems(task: TaskConfig, seed: int) -> dict[str, list[dict[str, Any]]]:
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
        splits[split] = [{"id": f"{split}-{i:06d}", "prompt": f"{a}+{b}=", "answer": str(a + b)}
                         for i, (a, b) in enumerate(chosen)]
    return splits


TASKS = {"addition": addition_problems}
