"""Datasets: the procedural task and JSONL reading with errors naming file and line."""

import json

import pytest

from components.config import TaskConfig
from components.data.records import DataError, file_md5, read_jsonl, write_jsonl
from components.data.tasks import addition_problems


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
