"""Datasets: the procedural task and JSONL reading with errors naming file and line."""

import json
import re

import pytest

from components.config import ConfigError, TaskConfig
from components.data.records import DataError, file_md5, read_jsonl, write_jsonl
from components.data.tasks import addition_problems, word_problems


def test_addition_splits_are_disjoint_deterministic_and_correct():
    task = TaskConfig(n_sft=200, n_train=300, n_heldout=100)
    a, b = addition_problems(task, 7), addition_problems(task, 7)
    assert a == b
    assert addition_problems(task, 8) != a
    prompts = {split: {r["prompt"] for r in rows} for split, rows in a.items()}
    assert len(prompts["sft"]) == 200 and len(prompts["train"]) == 300 and len(prompts["heldout"]) == 100
    assert not (prompts["sft"] & prompts["heldout"]) and not (prompts["train"] & prompts["heldout"])
    assert not (prompts["sft"] & prompts["train"])
    for row in a["train"]:
        x, y = row["prompt"].rstrip("=").split("+")
        assert int(row["answer"]) == int(x) + int(y)


def _solve_word_problem(question: str) -> int:
    """An independent reading of the four phrasings, to check the generator's answers."""
    a, b, c = (int(x) for x in re.findall(r"\d+", question))
    if "gives" in question:
        return a + b - c
    if "lost" in question:
        return a - b + c
    if "bags" in question:
        return a * b + c
    assert "Monday" in question
    return a + b + c


def test_word_problems_are_two_step_disjoint_by_arithmetic_and_answered_right():
    task = TaskConfig(name="word_problems", min_operand=1, max_operand=9, n_sft=5, n_train=800, n_heldout=200)
    a = word_problems(task, 3)
    assert a == word_problems(task, 3) and a != word_problems(task, 4)
    assert [len(a[s]) for s in ("sft", "train", "heldout")] == [5, 800, 200]
    kinds = ("gives", "lost", "bags", "Monday")
    numbers = {s: {tuple(re.findall(r"\d+", r["prompt"])) + tuple(k in r["prompt"] for k in kinds) for r in rows}
               for s, rows in a.items()}  # operands + phrasing: the arithmetic, whatever the name and item
    assert not (numbers["train"] & numbers["heldout"]) and not (numbers["sft"] & numbers["heldout"])
    for row in a["train"] + a["heldout"]:
        assert int(row["answer"]) == _solve_word_problem(row["prompt"]) >= 0
    assert {_solve_word_problem(r["prompt"]) for r in a["train"]} - {int(x) for r in a["train"]
                                                                    for x in re.findall(r"\d+", r["prompt"])}


def test_word_problem_range_too_small_is_refused_naming_the_key():
    tight = TaskConfig(name="word_problems", min_operand=1, max_operand=2, n_sft=1, n_train=200, n_heldout=20)
    # a + b - c: 8; a - b + c needs b <= a: 3 pairs x 2; bags: factors 2..9 squared x 2; a + b + c: 8 -> 150
    with pytest.raises(ConfigError, match=r"task.n_train: n_sft \+ n_train \+ n_heldout \(221\) exceeds the 150"):
        word_problems(tight, 0)
    assert len(word_problems(TaskConfig(name="word_problems", min_operand=1, max_operand=2, n_sft=1, n_train=129,
                                        n_heldout=20), 0)["train"]) == 129  # 150 exactly: every problem once


def test_jsonl_roundtrip_and_md5(tmp_path):
    rows = [{"id": "1", "prompt": "1+1=", "answer": "2", "source": "x"}]
    write_jsonl(tmp_path / "a.jsonl", rows)
    assert read_jsonl(tmp_path / "a.jsonl") == rows
    import hashlib
    assert file_md5(tmp_path / "a.jsonl") == hashlib.md5((tmp_path / "a.jsonl").read_bytes()).hexdigest()


def test_malformed_line_names_file_and_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"id": "1"}) + "\n" + "{not json\n")
    with pytest.raises(DataError, match=r"bad\.jsonl: line 2: malformed JSON"):
        read_jsonl(path)


def test_invalid_utf8_names_the_line(tmp_path):
    path = tmp_path / "bin.jsonl"
    path.write_bytes(b'{"id": "1"}\n{"id": "\xff"}\n')
    with pytest.raises(DataError, match=r"line 2: invalid UTF-8"):
        read_jsonl(path)


def test_empty_and_missing_files(tmp_path):
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(DataError, match="file is empty"):
        read_jsonl(tmp_path / "empty.jsonl")
    with pytest.raises(DataError, match="does not exist"):
        read_jsonl(tmp_path / "missing.jsonl")
