"""`grpo-pipeline evaluate-many`: two checkpoints evaluated in parallel by a Prefect process pool give the
same metrics as evaluating them one after another."""

from __future__ import annotations

import json
import os

import pytest

from components.engine.evaluation.heldout import score_checkpoint
from components.engine.models.modeling import ModelLoadError
from components.stages.grpo import train_grpo

from conftest import BIN, LEARN, ROOT, committed_params, run, setup_stage_inputs

pytestmark = pytest.mark.integration


@pytest.mark.own_prefect_api  # reads the task runs in its own Prefect home
def test_parallel_evaluation_of_two_checkpoints_matches_sequential(tmp_path, mlflow_store, prefect_home):
    (tmp_path / "params.yaml").write_text((committed_params()).read_text())
    cfg, paths = setup_stage_inputs(tmp_path, LEARN + ["grpo.steps=6", "grpo.checkpoint_every=3"])
    train_grpo(cfg, paths)
    (tmp_path / "params.yaml").write_text((committed_params()).read_text())  # the workers read it from root
    checkpoints = ["checkpoints/grpo/step-0000003", "models/grpo"]
    # Sequential reference, in this process and without Prefect; a training checkpoint loads as well.
    from components.config import load_config

    root_cfg = load_config(tmp_path / "params.yaml")
    expected = [score_checkpoint(root_cfg, tmp_path / c, paths) for c in checkpoints]
    assert expected[0]["n"] == 50 and all(0.0 <= e["mean_reward"] <= 1.0 for e in expected)

    out = tmp_path / "many.json"
    env = {"PREFECT_HOME": prefect_home(tmp_path / "prefect-home"),
           "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")])}
    proc = run([str(BIN / "grpo-pipeline"), "evaluate-many", *checkpoints, "--root", str(tmp_path), "--workers", "2",
                "--out", str(out)], tmp_path, env=env, timeout=300)
    assert "| held-out mean reward |" in proc.stdout
    report = json.loads(out.read_text())
    assert report["runner"] == "process"
    results = report["results"]
    assert [r["checkpoint"] for r in results] == [str(tmp_path / c) for c in checkpoints]
    for got, want in zip(results, expected):
        assert got["mean_reward"] == want["mean_reward"] and got["n"] == want["n"]
        assert got["completions"] == want["completions"] and got["rewards"] == want["rewards"]
    # Worker processes, not the CLI's own: the process pool really ran them, as Prefect task runs.
    assert all(r["pid"] != report["cli_pid"] for r in results)
    import sqlite3

    db = tmp_path / "prefect-home" / "prefect.db"
    states = sqlite3.connect(db).execute("SELECT name, state_type FROM task_run").fetchall()
    assert sorted((name.rsplit("-", 1)[0], state) for name, state in states) == [
        ("evaluate-grpo", "COMPLETED"), ("evaluate-step-0000003", "COMPLETED")]


def test_a_missing_checkpoint_is_a_clear_error(tmp_path):
    from components.config import load_config
    from components.data.paths import Paths

    with pytest.raises(ModelLoadError, match="no such model directory or checkpoint"):
        score_checkpoint(load_config(committed_params()), tmp_path / "nope", Paths(root=tmp_path))
