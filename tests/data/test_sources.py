"""Users' data formats, column mapping, the one-file split, and answer extraction."""

import csv
import json

import pytest

from components.config import load_config
from components.data.paths import Paths
from components.data.records import DataError, read_jsonl
from components.data.sources import load_records, split_heldout
from components.engine.rewards.extract import extract_answer
from components.engine.rewards.rewards import math_verify, numeric_match
from components.stages.prepare import prepare

from conftest import committed_params

# A common export format: question / answer / source, no id column.
ROWS = [{"question": "What is 2+3?", "answer": "5", "source": "ch1"},
        {"question": "What is 7*6?", "answer": "42", "source": "ch2"},
        {"question": "Half of 9?", "answer": "4.5", "source": "ch2"}]
MAPPING = {"question": "prompt"}
EXPECTED = [{"prompt": r["question"], "answer": r["answer"], "source": r["source"]} for r in ROWS]


def write_all_formats(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq
    from datasets import Dataset

    paths = {}
    paths["jsonl"] = tmp_path / "d.jsonl"
    paths["jsonl"].write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    paths["json"] = tmp_path / "d.json"
    paths["json"].write_text(json.dumps(ROWS, indent=1))
    paths["csv"] = tmp_path / "d.csv"
    with paths["csv"].open("w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=["question", "answer", "source"])
        writer.writeheader()
        writer.writerows(ROWS)
    paths["parquet"] = tmp_path / "d.parquet"
    pq.write_table(pa.Table.from_pylist(ROWS), paths["parquet"])
    paths["hf"] = tmp_path / "hf_dataset"
    Dataset.from_list(ROWS).save_to_disk(str(paths["hf"]))
    return paths


def test_every_format_gives_identical_records(tmp_path):
    for fmt, path in write_all_formats(tmp_path).items():
        assert load_records(path, "auto", MAPPING) == EXPECTED, fmt


def test_files_with_a_byte_order_mark_are_read(tmp_path):
    """Windows tools write a UTF-8 BOM before the first line: JSONL, JSON and CSV read as without it."""
    from components.stages.prepare import stream_copy

    for fmt, path in write_all_formats(tmp_path).items():
        if fmt in ("jsonl", "json", "csv"):
            bom = path.with_name("bom-" + path.name)
            bom.write_bytes(b"\xef\xbb\xbf" + path.read_bytes())
            assert load_records(bom, "auto", MAPPING) == EXPECTED, fmt
            if fmt == "jsonl":  # the streamed copy of a large JSONL file too
                stream_copy(str(bom), tmp_path / "copy.jsonl", "train", MAPPING)
                copied = [json.loads(line) for line in (tmp_path / "copy.jsonl").read_text().splitlines()]
                assert [{k: v for k, v in r.items() if k != "id"} for r in copied] == EXPECTED


def test_json_object_with_prompts_list(tmp_path):
    path = tmp_path / "prompts.json"
    path.write_text(json.dumps({"prompts": ["Write a haiku:", "Explain binary search:"]}))
    assert load_records(path) == [{"prompt": "Write a haiku:"}, {"prompt": "Explain binary search:"}]


def test_one_line_of_config_runs_seed_003_format_through_prepare(tmp_path, mlflow_store):
    path = tmp_path / "qa.json"
    rows = [{"question": f"What is {i}+{i}?", "answer": str(2 * i), "source": f"s{i % 3}"} for i in range(40)]
    path.write_text(json.dumps(rows))
    cfg = load_config(committed_params(), [f"data.train_path={path}", "data.columns={question: prompt}"])
    paths = Paths(root=tmp_path / "work")
    sources = prepare(cfg, paths)
    train, heldout, sft = (read_jsonl(paths.data / f"{s}.jsonl") for s in ("train", "heldout", "sft"))
    assert len(heldout) == 4 and len(train) == 36 and sft == train
    assert {r["prompt"] for r in train}.isdisjoint({r["prompt"] for r in heldout})
    assert all(r["source"].startswith("s") and r["id"].startswith("train-") for r in train + heldout)
    assert "held-out 0.1" in sources["heldout"] and "ids generated" in sources["train"]
    # Deterministic: the same seed splits the same way.
    again = Paths(root=tmp_path / "again")
    prepare(cfg, again)
    assert read_jsonl(again.data / "heldout.jsonl") == heldout


def test_split_keeps_identical_prompts_together():
    rows = [{"prompt": f"p{i % 10}", "answer": "x"} for i in range(100)]
    train, held = split_heldout(rows, 0.2, seed=3)
    assert len(held) == 20 and {r["prompt"] for r in train}.isdisjoint({r["prompt"] for r in held})


def test_ragged_csv_and_wrong_parquet_types_are_named(tmp_path):
    bad = tmp_path / "bad.csv"
    bad.write_text("prompt,answer\n1+1=,2\n2+2=,4,extra\n")
    with pytest.raises(DataError, match=r"bad\.csv: line 3: ragged row \(3 fields, header has 2\)"):
        load_records(bad)
    import pyarrow as pa
    import pyarrow.parquet as pq

    typed = tmp_path / "typed.parquet"
    pq.write_table(pa.Table.from_pylist([{"prompt": 12, "answer": "x"}]), typed)
    with pytest.raises(DataError, match=r"typed\.parquet: column 'prompt' has type int64, expected string"):
        load_records(typed)


COMPLETIONS = {
    "gsm8k": "Natalia sold 48/2 = 24 clips in May.\nShe sold 48+24 = 72 clips altogether.\n#### 72",
    "boxed": "We simplify: $\\frac{2}{4} = \\frac{1}{2}$, so the answer is $\\boxed{\\frac{1}{2}}$.",
    "trailing": "The answer is 1,234 apples. Let me know if you need anything else!",
    "wrong": "Adding them gives 71.\n#### 71",
    "nested": "Thus \\boxed{x^{2}+\\sqrt{4}} holds.",
}


def test_extractors_on_real_looking_completions():
    assert extract_answer(COMPLETIONS["gsm8k"], "####") == "72"
    assert extract_answer(COMPLETIONS["boxed"], "boxed") == "\\frac{1}{2}"
    assert extract_answer(COMPLETIONS["nested"], "boxed") == "x^{2}+\\sqrt{4}"
    assert extract_answer(COMPLETIONS["trailing"], "last_number") == "1234"
    assert extract_answer(COMPLETIONS["gsm8k"], r"regex:= (\d+) clips") == "72"  # last match wins
    assert extract_answer("no marker", "####") is None and extract_answer("none", "boxed") is None


def test_math_verify_reward_numeric_and_symbolic():
    comps = [COMPLETIONS["gsm8k"], COMPLETIONS["boxed"], COMPLETIONS["wrong"], COMPLETIONS["boxed"]]
    answers = ["72", "0.5", "72", "1/3"]
    assert math_verify(["p"] * 4, comps, answers) == [1.0, 1.0, 0.0, 0.0]
    assert math_verify(["p"] * 2, comps[:2], ["72", "\\frac{2}{4}"], extract="####") == [1.0, 0.0]
    assert numeric_match(["p"] * 2, [COMPLETIONS["trailing"], COMPLETIONS["wrong"]], ["1234", "72"],
                         extract="last_number") == [1.0, 0.0]
