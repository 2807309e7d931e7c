"""Built-in procedural tasks: verifiable problems a tiny model can learn on two CPU cores."""

from __future__ import annotations

import random
from typing import Any

from components.config import ConfigError, TaskConfig


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


NAMES = ("Ana", "Ben", "Chen", "Dara", "Eli", "Fatima", "Gus", "Hana", "Ivan", "Jada", "Kofi", "Lena", "Mateo", "Nia",
         "Omar", "Priya", "Quinn", "Rosa", "Sami", "Tara")
ITEMS = ("apples", "marbles", "stickers", "pencils", "cookies", "coins", "stamps", "books", "shells", "cards")
# Two operations each, so the answer is not any number in the question: the model has to carry an intermediate
# result. (question template, answer(a, b, c)); SOLUTIONS[k] works WORD_PROBLEMS[k] out for the SFT warm start.
WORD_PROBLEMS: tuple[tuple[str, Any], ...] = (
    ("{n} has {a} {i}. {n} buys {b} more and then gives {c} away. How many {i} does {n} have now?",
     lambda a, b, c: a + b - c),
    ("{n} had {a} {i}, lost {b} of them, and then found {c} more. How many {i} does {n} have now?",
     lambda a, b, c: a - b + c),
    ("{n} has {a} bags with {b} {i} in each bag, and {c} loose {i}. How many {i} does {n} have in all?",
     lambda a, b, c: a * b + c),
    ("{n} has {a} {i}, gets {b} more on Monday and {c} more on Tuesday. How many {i} does {n} have now?",
     lambda a, b, c: a + b + c),
)

SOLUTIONS = (
    "{n} starts with {a} {i}. After buying {b} more, {n} has {a} + {b} = {ab} {i}. After giving {c} away, {n} has "
    "{ab} - {c} = {x} {i}. The answer is {x}.",
    "{n} starts with {a} {i}. After losing {b}, {n} has {a} - {b} = {ab} {i}. After finding {c} more, {n} has "
    "{ab} + {c} = {x} {i}. The answer is {x}.",
    "Each bag has {b} {i}, so {a} bags hold {a} x {b} = {ab} {i}. With the {c} loose {i}, {n} has {ab} + {c} = {x} "
    "{i}. The answer is {x}.",
    "{n} starts with {a} {i}. After Monday, {n} has {a} + {b} = {ab} {i}. After Tuesday, {n} has {ab} + {c} = {x} "
    "{i}. The answer is {x}.",
)
FIRST_STEP = (lambda a, b: a + b, lambda a, b: a - b, lambda a, b: a * b, lambda a, b: a + b)


def _word_problem_operands(task: TaskConfig) -> list[tuple[int, int, int, int]]:
    """Every (template, a, b, c) of the operand range whose intermediate and final counts are non-negative; a
    product's factors lie in [2, 9]."""
    span, factors = range(max(task.min_operand, 1), task.max_operand + 1), range(2, 10)
    cases = []
    for k, (template, answer_of) in enumerate(WORD_PROBLEMS):
        firsts = factors if "bags" in template else span
        cases += [(k, a, b, c) for a in firsts for b in firsts for c in span
                  if FIRST_STEP[k](a, b) >= 0 and answer_of(a, b, c) >= 0]
    return cases


def word_problems(task: TaskConfig, seed: int) -> dict[str, list[dict[str, Any]]]:
    """Two-step arithmetic word problems ("Ana has 7 apples. Ana buys 5 more and then gives 3 away. ...") -> "9".

    Splits are disjoint by the arithmetic (template and operands), not just by wording, so the held-out split
    asks sums the policy never trained on. Operands lie in [max(min_operand, 1), max_operand]. SFT rows also
    carry `solution`: the two steps worked out, ending "The answer is N." (scored by the last number).
    """
    rng = random.Random(seed)
    cases = _word_problem_operands(task)
    wanted = task.n_sft + task.n_train + task.n_heldout
    if wanted > len(cases):
        raise ConfigError(f"task.n_train: n_sft + n_train + n_heldout ({wanted}) exceeds the {len(cases)} distinct "
                          f"word problems of operands {max(task.min_operand, 1)}..{task.max_operand}")
    rng.shuffle(cases)
    splits: dict[str, list[dict[str, Any]]] = {}
    start = 0
    for split, size in {"sft": task.n_sft, "train": task.n_train, "heldout": task.n_heldout}.items():
        rows = []
        for i, (k, a, b, c) in enumerate(cases[start: start + size]):
            template, answer_of = WORD_PROBLEMS[k]
            name, item = rng.choice(NAMES), rng.choice(ITEMS)
            row = {"id": f"{split}-{i:06d}", "prompt": template.format(n=name, i=item, a=a, b=b, c=c),
                   "answer": str(answer_of(a, b, c))}
            if split == "sft":  # worked solutions, for `sft.target_column: solution`
                row["solution"] = SOLUTIONS[k].format(n=name, i=item, a=a, b=b, c=c, ab=FIRST_STEP[k](a, b),
                                                      x=row["answer"])
            rows.append(row)
        splits[split] = rows
        start += size
    return splits


def multiplication(task: TaskConfig, seed: int) -> dict[str, list[dict[str, Any]]]:
    """Products of a number in [min_operand, max_operand] and a two-digit one ("What is 347 * 82?" -> "28454"), beyond
    what a small model computes in its head: a task for a calculator tool. Disjoint splits, drawn without
    replacement. SFT rows also carry `tool_solution`: the worked conversation after the prompt (a call of the
    `calculator` tool, its result, the answer), for `sft.target_column: tool_solution`."""
    pairs = [(a, b) for a in range(task.min_operand, task.max_operand + 1) for b in range(10, 100)]
    rng = random.Random(seed)
    rng.shuffle(pairs)
    splits: dict[str, list[dict[str, Any]]] = {}
    start = 0
    for split, size in {"sft": task.n_sft, "train": task.n_train, "heldout": task.n_heldout}.items():
        rows = []
        for i, (a, b) in enumerate(pairs[start: start + size]):
            row = {"id": f"{split}-{i:06d}", "prompt": f"What is {a} * {b}?", "answer": str(a * b)}
            if split == "sft":
                call = {"type": "function",
                        "function": {"name": "calculator", "arguments": {"expression": f"{a} * {b}"}}}
                row["tool_solution"] = [{"role": "assistant", "content": "", "tool_calls": [call]},
                                        {"role": "tool", "name": "calculator", "content": str(a * b)},
                                        {"role": "assistant", "content": str(a * b)}]
            rows.append(row)
        splits[split] = rows
        start += size
    return splits


TASKS = {"addition": addition_problems, "addition_question": addition_questions, "word_problems": word_problems,
         "multiplication": multiplication}
