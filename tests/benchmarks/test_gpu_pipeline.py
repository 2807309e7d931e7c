"""The pipeline's GPU run prepared on the CPU: the wheels it brings (the frameworks the GPU image lacks, in parts that
each fit a transfer), its calls checking the warm machine they need before anything else, and its record read from a
call's output folder with hand-computed figures."""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from benchmarks.device.pipeline_wheels import pipeline_requirements, split
from benchmarks.gpu_pipeline import markdown, record

from conftest import ROOT


def test_the_wheels_are_the_frameworks_and_what_they_need_beyond_the_image():
    names = {r.split("==")[0].lower().replace("_", "-") for r in pipeline_requirements()}
    assert {"prefect", "mlflow", "dvc", "great-expectations", "gguf", "antlr4-python3-runtime", "sqlalchemy"} <= names
    assert not names & {"torch", "transformers", "numpy", "pandas", "grpo-pipeline"}
    assert all("==" in r for r in pipeline_requirements())  # pinned to what is installed here


def test_wheels_split_into_parts_that_each_fit_a_transfer(tmp_path):
    source = tmp_path / "all"
    source.mkdir()
    for name, mib in {"a": 5, "b": 4, "c": 3, "d": 3, "e": 1}.items():
        (source / f"{name}-1-py3-none-any.whl").write_bytes(b"x" * (mib << 20))
    parts = split(source, tmp_path / "parts", part_mib=8)
    # largest first, each into the part with the most room: 5+3, then 4+3+1
    assert parts == [["a-1-py3-none-any.whl", "d-1-py3-none-any.whl"],  # c before d (same size: by name)
                     ["b-1-py3-none-any.whl", "c-1-py3-none-any.whl", "e-1-py3-none-any.whl"]]
    assert sorted(p.name for p in (tmp_path / "parts" / "b").iterdir()) == parts[1]
    with pytest.raises(ValueError, match="more than a part"):
        split(source, tmp_path / "small", part_mib=4.5)
    with pytest.raises(ValueError, match="need 3 parts"):  # more parts than the calls install
        split(source, tmp_path / "three", part_mib=6, parts_at_most=2)


def _call2(cwd) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(ROOT / "benchmarks" / "device" / "pipeline_call2.sh")], cwd=cwd,
                          capture_output=True, text=True, timeout=60, env={**os.environ, "OUT": str(cwd)})


def test_the_run_call_stops_first_when_the_machine_was_not_kept_warm(tmp_path):
    proc = _call2(tmp_path)
    assert proc.returncode == 3 and "run pipeline_call1.sh first" in proc.stdout
    (tmp_path / ".device-keep" / "wheels").mkdir(parents=True)
    (tmp_path / ".device-keep" / "wheels" / ".part-a").touch()
    proc = _call2(tmp_path)
    assert proc.returncode == 3 and "no GGUF in .device-keep" in proc.stdout
    assert not (tmp_path / ".device-keep" / "bin").exists() and "pip" not in proc.stderr


def test_a_calls_output_is_recorded_from_the_runs_own_records(tmp_path):
    out = tmp_path
    (out / "pipeline_status.json").write_text('{"exit_status": 0, "wall_s": 301}')
    (out / "card.txt").write_text("NVIDIA H200, 143771 MiB\n")
    (out / "pipeline.txt").write_text("12:00 | INFO | Task run 'stage-sft' - stage sft ran in 41.5s\n"
                                      "Stage 'prepare' didn't change, skipping\n"
                                      "12:01 | INFO | Task run 'stage-grpo' - stage grpo ran in 120.25s\n")
    (out / "metrics").mkdir()
    (out / "metrics" / "eval.json").write_text(json.dumps({
        "n": 200, "baseline": {"mean_reward": 0.31}, "candidate": {"mean_reward": 0.42},
        "improvement": {"mean": 0.11, "ci95_low": 0.05, "ci95_high": 0.17}}))
    (out / "plots").mkdir()
    (out / "plots" / "grpo_steps.csv").write_text("step,completions_per_s,completion_length\n1,10,100\n2,20,50\n"
                                                  "3,30,40\n4,10,90\n")
    (out / "gpu_memory_mib.txt").write_text("512\n20480\n10240\n")
    (out / "served.json").write_text('{"model": "models:/m/1", "answer": ["9"]}')
    (out / "packages.json").write_text('[{"name": "torch", "version": "2.11.0"}, {"name": "great-expectations", '
                                       '"version": "1.24.1"}]')
    found = record(out)
    assert found["stage_seconds"] == {"sft": 41.5, "grpo": 120.25}  # the skipped stage left out
    assert found["heldout"]["improvement_ci95_low"] == 0.05 and found["heldout"]["after"] == 0.42
    assert found["grpo_completion_tokens_per_s"] == 1000.0  # median of 1000, 1200, 900 (the first step left out)
    assert found["peak_gpu_memory_in_use_gib"] == 20.0
    assert found["versions"]["torch"] == "2.11.0" and found["versions"]["great_expectations"] == "1.24.1"
    assert found["versions"]["prefect"] is None and found["served"]["answer"] == ["9"]
    assert "improvement +0.1100 (95% CI +0.0500 .. +0.1700)" in markdown(found)
