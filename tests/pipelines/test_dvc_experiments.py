"""DVC's own experiment workflow on the pipeline (docs/operations.md "DVC experiments"): `dvc exp run -S` in the
workspace (which leaves its value in params.yaml, and `git checkout -- params.yaml` takes it out), a queue of two run
by `dvc queue start` in temporary copies (params.yaml untouched), `dvc exp show` with each experiment's held-out
figures side by side, and `dvc exp apply`. Real git + DVC on the fast preset; every experiment's MLflow runs and
checkpoints land where a plain run's do (the repository's mlflow.db and checkpoints/), also those the queue ran in
temporary copies."""

from __future__ import annotations

import os
import subprocess
import time

import pytest

from conftest import BIN, copy_committed_project, run

pytestmark = [pytest.mark.slow, pytest.mark.integration]


def test_dvc_experiments_run_queue_show_and_apply(tmp_path, monkeypatch):
    import yaml
    from dvc.api import exp_show
    from mlflow.tracking import MlflowClient

    from pipelines.params_io import apply_to_params, preset_path

    repo = copy_committed_project(tmp_path / "repo")
    apply_to_params(repo / "params.yaml", [preset_path("fast_test")], ["threads=1"])
    run(["git", "commit", "-qam", "the fast preset as my settings"], repo)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)  # the default store: ./mlflow.db (the server too)
    env = dict(os.environ)  # with the worker's shared stage server (conftest.py): not what is under test
    dvc = str(BIN / "dvc")

    def kl_beta() -> float:
        return yaml.safe_load((repo / "params.yaml").read_text())["grpo"]["kl_beta"]

    committed = kl_beta()
    ran = run([dvc, "exp", "run", "-S", "grpo.kl_beta=0.1"], repo, env=env).stdout
    # in the workspace: its value stays in params.yaml, as DVC says; the next plain run would train it
    assert kl_beta() == 0.1 and "applied to your workspace" in ran, ran[-2000:]
    for beta in ("0.2", "0.3"):
        run([dvc, "exp", "run", "--queue", "-S", f"grpo.kl_beta={beta}"], repo, env=env)
        assert kl_beta() == 0.1  # queued: the workspace is not touched
    run([dvc, "queue", "start"], repo, env=env)
    deadline = time.time() + 900
    while time.time() < deadline:
        status = run([dvc, "queue", "status"], repo, env=env).stdout
        if "Queued" not in status and "Running" not in status:
            break
        time.sleep(1)
    assert status.count("Success") == 2, status + run([dvc, "queue", "logs", "--help"], repo, check=False).stdout
    assert kl_beta() == 0.1  # the queue ran in temporary copies: params.yaml as the workspace run left it
    run(["git", "checkout", "--", "params.yaml"], repo)  # the way back the docs give
    assert kl_beta() == committed != 0.1

    shown = exp_show(repo=str(repo))
    experiments = {row["grpo.kl_beta"]: row for row in shown if row.get("Experiment")}
    assert sorted(experiments) == [0.1, 0.2, 0.3], shown
    for row in experiments.values():  # each experiment's held-out figures, side by side
        assert isinstance(row["candidate.mean_reward"], float) and isinstance(row["improvement.mean"], float), row
    table = run([dvc, "exp", "show", "--md", "--drop", ".*", "--keep",
                 "Experiment|grpo.kl_beta|candidate.mean_reward|improvement.mean"], repo, env=env).stdout
    assert all(name in table for name in (row["Experiment"] for row in experiments.values())), table

    # Where a plain run's land: the repository's own store and checkpoints, none in the queue's copies.
    client = MlflowClient(f"sqlite:///{repo / 'mlflow.db'}")
    grpo_runs = client.search_runs([e.experiment_id for e in client.search_experiments()],
                                   filter_string="tags.`grpo.stage` = 'grpo'")
    assert sorted(float(r.data.params["grpo.kl_beta"]) for r in grpo_runs) == [0.1, 0.2, 0.3]
    aside = sorted(p.name for p in (repo / "checkpoints" / "grpo-other-inputs").iterdir())
    assert len(aside) == 2 and list((repo / "checkpoints" / "grpo").glob("step-*"))  # three inputs, three sets
    stray = subprocess.run(["find", str(repo / ".dvc" / "tmp"), "-name", "mlflow.db", "-o", "-name", "step-*"],
                           capture_output=True, text=True).stdout
    assert stray == ""

    chosen = experiments[0.2]
    run([dvc, "exp", "apply", chosen["Experiment"]], repo, env=env)
    assert yaml.safe_load((repo / "params.yaml").read_text())["grpo"]["kl_beta"] == 0.2
    applied = yaml.safe_load((repo / "metrics" / "eval.json").read_text())
    assert applied["candidate"]["mean_reward"] == chosen["candidate.mean_reward"]
    assert "Data and pipelines are up to date." in run([dvc, "status"], repo, env=env).stdout
