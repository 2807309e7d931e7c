"""Faults from outside the pipeline, injected for real into `grpo-pipeline run`: the tracking server dies mid-GRPO
and is back only for the rerun; DVC cannot write an output into its cache; the whole run is SIGKILLed while its
one-off overrides sit in params.yaml. Each fails (or is found, on the rerun) in one line, nothing is lost, and the
rerun trains nothing that had finished."""

from __future__ import annotations

import os
import re
import resource
import signal
import subprocess
import time
from pathlib import Path

import pytest

from components.locks import PIPELINE_LOCK, file_lock
from components.runtime.stage_server import SERVER_ENV

from conftest import (
    BIN,
    FAST_PARAMS,
    ROOT,
    copy_committed_project,
    free_port,
    run,
    start_mlflow_server,
    stop_server_group,
)

pytestmark = pytest.mark.slow

LEARNS = ["grpo.rewards=[{name: 'reward_fixtures:starts_with_one', weight: 1.0}]", "grpo.learning_rate=0.003"]


def cli(overrides: list[str]) -> list[str]:
    return [str(BIN / "grpo-pipeline"), "run", *[x for o in overrides for x in ("--set", o)]]


def start(repo: Path, overrides: list[str], env: dict) -> subprocess.Popen:
    return subprocess.Popen(cli(overrides), cwd=repo, env={**os.environ, **env}, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)


def read_until(proc: subprocess.Popen, pattern: str, lines: list[str]) -> None:
    for line in proc.stdout:
        lines.append(line)
        if re.search(pattern, line):
            return
    raise AssertionError(f"never printed {pattern!r}:\n{''.join(lines)[-3000:]}")


def finish(proc: subprocess.Popen, lines: list[str]) -> str:
    lines.extend(proc.stdout)
    proc.wait(timeout=600)
    return "".join(lines)


@pytest.mark.integration
def test_a_registry_outage_keeps_the_finished_stages_and_the_rerun_trains_nothing(tmp_path, prefect_home):
    """The tracking server (a real `mlflow server`) dies while GRPO trains: GRPO and evaluate finish logging to the
    on-disk queue, the outage is said once, register is retried once (said in one line: the server, when) and stops
    with one line; dvc.lock and the finished stages' outputs stay. The server restarts; the same command again sends
    the queue, runs no GRPO step and registers."""
    from mlflow.tracking import MlflowClient

    repo = copy_committed_project(tmp_path / "repo")
    port = free_port()
    uri = f"http://127.0.0.1:{port}"
    env = {"MLFLOW_TRACKING_URI": uri, "PREFECT_HOME": prefect_home(tmp_path / "prefect"), "GRPO_TRACKING_RETRY_S": "1",
           "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "1", "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
           "PYTHONPATH": str(ROOT / "tests")}
    steps = [p for p in FAST_PARAMS if not p.startswith("grpo.steps")] + [
        "grpo.steps=12", "grpo.rewards=[{name: 'reward_fixtures:starts_with_one_slowly', weight: 1.0}]",
        "operations.stage_retries=1", "operations.retry_delay_s=1"]  # the outage is retried once, and said
    server = start_mlflow_server(tmp_path, port)
    try:
        proc, lines = start(repo, steps, env), []
        read_until(proc, r"^grpo: step 3/12", lines)
        stop_server_group(server)  # gone mid-GRPO
        out = finish(proc, lines)
        assert proc.returncode == 1, out[-3000:]
        assert out.count(f"tracking: the MLflow tracking server at {uri} does not answer") == 1, out[-4000:]
        assert "grpo: step 12/12" in out and "Traceback" not in out
        # register's connection failed: the stage is retried once, said in one line of the pipeline's own
        retried = [line for line in out.splitlines() if "the stage runs again in" in line]
        assert len(retried) == 1 and retried[0].startswith(f"register: the MLflow tracking server at {uri} did not "
                                                           "answer; the stage runs again in 1 s (at "), out[-4000:]
        assert retried[0].endswith("; retry 1 of 1)") and "Retry 1/1 will start" not in out
        assert out.count("Running stage 'register'") == 2
        error = next(line for line in out.splitlines() if line.startswith("error: "))
        assert error.startswith(f"error: register: the MLflow tracking server at {uri} did not answer after bounded "
                                "retries") and "rerun when it is back" in error
        assert "kept what the finished stages produced (prepare, model, validate, sft, grpo, evaluate" in out
        assert (repo / "models" / "grpo" / "model.safetensors").exists() and (repo / "dvc.lock").exists()
        status = run([str(BIN / "dvc"), "status"], repo, env=env).stdout
        assert "grpo:" not in status and "evaluate:" not in status and "register:" in status, status

        server = start_mlflow_server(tmp_path, port)  # back for the rerun
        rerun = run(cli(steps), repo, env=env)
        assert "Running stage 'grpo'" not in rerun.stdout and "grpo: step" not in rerun.stdout, rerun.stdout[-3000:]
        assert rerun.stdout.count("tracking: the tracking server answers again: sent ") == 1
        assert "registered model: models:/grpo-addition/1" in rerun.stdout
        client = MlflowClient(uri)
        runs = client.search_runs([e.experiment_id for e in client.search_experiments()])
        grpo = [r for r in runs if r.info.run_name == "grpo"]
        assert len(grpo) == 1 and grpo[0].info.status == "FINISHED"  # sent from the queue: it trained once
        assert len(client.get_metric_history(grpo[0].info.run_id, "learning/reward_mean")) == 6
    finally:
        stop_server_group(server)


def test_a_cache_write_dvc_cannot_make_fails_the_run_in_one_line_and_the_rerun_trains_nothing(tmp_path, prefect_home):
    """DVC cannot copy models/grpo into its cache (the run's files may not exceed 1 MB from GRPO on: what a full or
    small device answers): the run stops before register in one line naming the output and the cache, no
    traceback, nothing registered; the rerun with room stores what was trained and runs no GRPO step."""
    from mlflow.tracking import MlflowClient

    repo = copy_committed_project(tmp_path / "repo")
    env = {"MLFLOW_TRACKING_URI": f"sqlite:///{repo / 'mlflow.db'}", "PREFECT_HOME": prefect_home(tmp_path / "prefect"),
           "PYTHONPATH": str(ROOT / "tests")}
    overrides = FAST_PARAMS + LEARNS
    proc, lines = start(repo, overrides, env), []
    read_until(proc, r"^Running stage 'grpo'", lines)
    # From now on the CLI (where DVC writes its cache) may write no file over 1 MB; GRPO itself (a process the
    # stage server forked before) is not limited, so its model (2.6 MB) is written, and DVC's copy of it is refused.
    resource.prlimit(proc.pid, resource.RLIMIT_FSIZE, (1 << 20, resource.RLIM_INFINITY))
    out = finish(proc, lines)
    assert proc.returncode == 1, out[-3000:]
    assert "Traceback" not in out and "failed to transfer" not in out, out[-3000:]
    error = next(line for line in out.splitlines() if line.startswith("error: "))
    assert error == (f"error: grpo: DVC could not store models/grpo in its cache {repo / '.dvc' / 'cache'} (File too "
                     "large): the device is full, the file too large for it, or the cache not writable; the stage's "
                     "work is kept in the workspace and dvc.lock: make room (or `dvc cache dir` elsewhere) and rerun: "
                     "it is stored then, not run again")
    assert "Running stage 'register'" not in out and "Running stage 'evaluate'" not in out
    client = MlflowClient(env["MLFLOW_TRACKING_URI"])
    assert client.search_registered_models() == []

    rerun = run(cli(overrides), repo, env=env)
    assert "grpo: stored models/grpo in the DVC cache" in rerun.stdout
    assert "Running stage 'grpo'" not in rerun.stdout and "grpo: step" not in rerun.stdout
    assert "registered model: models:/grpo-addition/1" in rerun.stdout
    assert run([str(BIN / "dvc"), "status"], repo, env=env).stdout.strip().endswith("up to date.")


@pytest.mark.own_stage_server  # the whole run killed: its own stage server with it
def test_a_killed_override_run_gives_the_users_settings_back_and_its_mlflow_runs_are_marked_killed(
        tmp_path, prefect_home, stage_server):
    """`grpo-pipeline run --set ...` SIGKILLed mid-GRPO (the machine preempted) leaves its one-off overrides in
    params.yaml and its MLflow runs RUNNING; the user edits params.yaml; the same command again puts the user's own
    settings back first, keeping that edit and saying so in one line, and marks the killed run's MLflow runs
    KILLED."""
    from mlflow.tracking import MlflowClient

    repo = copy_committed_project(tmp_path / "repo")
    env = {"MLFLOW_TRACKING_URI": f"sqlite:///{repo / 'mlflow.db'}", "PREFECT_HOME": prefect_home(tmp_path / "prefect")}
    mine = (repo / "params.yaml").read_text()
    overrides = [p for p in FAST_PARAMS if not p.startswith(("grpo.steps", "grpo.checkpoint_every"))] + [
        "grpo.steps=40", "grpo.checkpoint_every=5"]
    proc, lines = start(repo, overrides, env), []
    read_until(proc, r"^grpo: step 6/40", lines)  # past the first checkpoint (step 5)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    deadline = time.time() + 60  # the stage server stops its stage when the launcher is gone
    while time.time() < deadline and (repo / "checkpoints" / "grpo.running.json").exists():
        time.sleep(0.2)
    # the run lock (flock) is free once the forked helpers holding it (the temporary API, the stage server) have
    # followed the killed CLI, as a user who reran too soon is told to wait for
    with file_lock(repo / PIPELINE_LOCK, "the killed run", wait_s=max(deadline - time.time(), 1.0)):
        pass
    assert "steps: 40" in (repo / "params.yaml").read_text()  # the killed run's one-off settings
    edited = (repo / "params.yaml").read_text().replace("learning_rate: 0.0005", "learning_rate: 0.0004")
    (repo / "params.yaml").write_text(edited)  # the user's edit, made in the file that still holds them

    rerun = run(cli(overrides), repo, env={**env, SERVER_ENV: stage_server[1]})  # the killed run's server is gone
    said = [line for line in rerun.stdout.splitlines() if line.startswith("params.yaml: back to your own")]
    assert said == ["params.yaml: back to your own settings (the previous run's one-off overrides (" + " ".join(
        f"--set {o}" for o in overrides) + "), whose run was stopped before it could put your settings back, were "
        "still in it), keeping your edit since: grpo.learning_rate: 0.0004"], rerun.stdout[:3000]
    own = mine.replace("learning_rate: 0.0005", "learning_rate: 0.0004")
    assert (repo / ".params.base.yaml").read_text() == own  # the user's own, with the edit, for the next plain run
    assert "learning_rate: 0.0004" in (repo / "params.yaml").read_text()
    assert re.search(r"mlflow: a previous pipeline run was killed before it could close its MLflow runs; marked "
                     r"KILLED: .*grpo-addition", rerun.stdout), rerun.stdout[:3000]
    client = MlflowClient(env["MLFLOW_TRACKING_URI"])
    runs = client.search_runs([e.experiment_id for e in client.search_experiments()])
    assert [r.info.run_name for r in runs if r.info.status == "RUNNING"] == []
    killed = [r for r in runs if r.info.status == "KILLED"]
    assert any(r.data.tags.get("grpo.stage") == "pipeline" for r in killed)
