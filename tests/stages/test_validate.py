"""The Great Expectations stage on real suites: each broken rule reported with file, rule and ids."""

import json

import pytest

from components.config import load_config
from components.data.paths import Paths
from components.data.records import write_jsonl
from components.errors import StageFailed
from components.stages.model import build_base_model
from components.stages.prepare import prepare
from components.stages.validate import validate

from conftest import committed_params


def rows(prefix, pairs):
    return [{"id": f"{prefix}{i}", "prompt": p, "answer": a} for i, (p, a) in enumerate(pairs)]


@pytest.fixture
def user_data(tmp_path):
    good = {
        "sft": rows("s", [("1+1=", "2"), ("2+2=", "4"), ("3+1=", "4")]),
        "train": rows("t", [("4+4=", "8"), ("5+1=", "6"), ("6+2=", "8")]),
        "heldout": rows("h", [("7+1=", "8"), ("8+1=", "9"), ("9+9=", "18")]),
    }
    return tmp_path, good


def run_validate(tmp_path, splits, overrides=()):
    files = {}
    for split, records in splits.items():
        files[split] = tmp_path / f"user_{split}.jsonl"
        write_jsonl(files[split], records)
    cfg = load_config(committed_params(), [f"data.{s}_path={p}" for s, p in files.items()] + list(overrides))
    paths = Paths(root=tmp_path / "work")
    prepare(cfg, paths)
    build_base_model(cfg, paths)
    return files, paths, lambda: validate(cfg, paths)


def test_clean_data_passes_and_report_is_saved(user_data):
    tmp_path, good = user_data
    _, paths, check = run_validate(tmp_path, good)
    assert check() == []
    report = json.loads((paths.metrics / "validation.json").read_text())
    assert report["success"] is True and report["files"]["train"]["rows"] == 3


def test_empty_prompt_duplicate_id_and_leak_are_each_reported(user_data):
    tmp_path, good = user_data
    good["train"][1]["prompt"] = "   "             # whitespace-only prompt, id t1
    good["train"][2]["id"] = "t0"                  # duplicate id t0 (rows 1 and 3)
    good["sft"].append({"id": "s9", "prompt": "9+9=", "answer": "18"})        # exact leak into held-out
    good["sft"].append({"id": "s10", "prompt": " 8+1= ", "answer": "9"})     # leak after normalisation
    files, paths, check = run_validate(tmp_path, good)
    with pytest.raises(StageFailed) as err:
        check()
    msg = str(err.value)
    assert f"{files['train']}" in msg and f"{files['sft']}" in msg
    assert "rule 'prompt not empty or whitespace' failed" in msg and "ids [t1]" in msg
    assert "rule 'unique ids' failed" in msg and "ids [t0, t0] (rows 1, 3)" in msg
    assert "rule 'no prompt shared with held-out data' failed" in msg and "ids [s9]" in msg
    assert "after whitespace/case normalisation' failed" in msg and "s10" in msg
    report = json.loads((paths.metrics / "validation.json").read_text())
    assert report["success"] is False
    assert {v["rule"] for v in report["violations"]} >= {"unique ids", "prompt not empty or whitespace"}


def test_missing_column_null_answer_and_non_string_prompt(user_data):
    tmp_path, good = user_data
    good["heldout"][0]["answer"] = None
    good["train"][0]["prompt"] = 42
    for r in good["sft"]:
        del r["answer"]
    _, _, check = run_validate(tmp_path, good)
    with pytest.raises(StageFailed) as err:
        check()
    msg = str(err.value)
    assert "user_sft.jsonl" in msg and "rule 'required column 'answer'' failed" in msg
    assert "rule 'answer present (the reward needs it)' failed" in msg and "ids [h0]" in msg
    assert "rule 'prompt is a string' failed" in msg and "ids [t0]" in msg


def test_sft_target_column_must_be_present_and_fit_the_context(user_data):
    tmp_path, good = user_data
    good["sft"][0]["solution"] = "1 + 1 = 2. The answer is 2."  # 28 characters after a 4-character prompt: fits
    good["sft"][1]["solution"] = "2 + 2 = 4. " * 3               # 37 + 4 > the tiny model's 32-token context
    _, _, check = run_validate(tmp_path, good, ["sft.target_column=solution"])
    with pytest.raises(StageFailed) as err:
        check()
    msg = str(err.value)
    assert "rule 'sft.target_column 'solution' present (SFT learns to write it)' failed" in msg and "ids [s2]" in msg
    assert "rule 'prompt + solution within context (32 tokens)' failed" in msg and "ids [s1]" in msg
    good["sft"] = [r for r in good["sft"] if r["id"] == "s0"]
    assert run_validate(tmp_path, good, ["sft.target_column=solution"])[2]() == []


def test_prompt_longer_than_context_is_refused(user_data):
    tmp_path, good = user_data
    good["train"][0]["prompt"] = "1+" * 20 + "1="  # 42 characters > 32-token context of the tiny model
    _, _, check = run_validate(tmp_path, good)
    with pytest.raises(StageFailed, match=r"prompt \+ completion within context .* ids \[t0\]"):
        check()


def test_a_prompt_repeated_with_another_answer_is_refused_naming_both_rows(user_data, capsys):
    tmp_path, good = user_data
    good["train"].append({"id": "t3", "prompt": "5+1=", "answer": "7"})   # contradicts t1 (row 2)
    good["train"].append({"id": "t4", "prompt": "4+4=", "answer": "8"})   # repeats t0 with the same answer
    _, _, check = run_validate(tmp_path, good)
    with pytest.raises(StageFailed) as err:
        check()
    msg = str(err.value)
    assert "one answer per prompt" in msg and "t3 contradicts row 2" in msg, msg
    assert "t4" not in msg  # an identical repeat is only a warning
    assert "1 row(s) repeat an earlier prompt with the same answer" in capsys.readouterr().out


def test_identical_repeats_pass_with_a_warning(user_data, capsys):
    tmp_path, good = user_data
    good["train"].append({"id": "t4", "prompt": "4+4=", "answer": "8"})
    _, _, check = run_validate(tmp_path, good)
    assert check() == []
    assert "repeat an earlier prompt with the same answer" in capsys.readouterr().out
