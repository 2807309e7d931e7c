"""Ctrl-C and SIGTERM during GRPO: a quick clean stop with one line, the flow run Cancelled, and a rerun
that resumes from the last checkpoint. Real signals to a real `grpo-pipeline run`."""

from __future__ import annotations

import os
import re
import signal
import sqlite3
import subprocess
import time
from pathlib import Path

import pytest

from conftest import BIN, FAST_PARAMS, copy_committed_project, run

# Signals to the run's processes, its stage server's included: each stopped run starts its own.
pytestmark = [pytest.mark.slow, pytest.mark.own_stage_server, pytest.mark.own_prefect_api]

# Long enough to be stopped mid-GRPO (about 0.3 s a step): checkpoints every 5 of 40 steps.
LONG_GRPO = [p for p in FAST_PARAMS if not p.startswith(("grpo.steps", "grpo.checkpoint_every", "grpo.log_every"))] \
    + ["grpo.steps=40", "grpo.checkpoint_every=5", "grpo.log_every=5"]


def start_run(repo: Path, env: dict) -> subprocess.Popen:
    cli = [str(BIN / "grpo-pipeline"), "run"] + [x for o in LONG_GRPO for x in ("--set", o)]
    # Its own process group, as a shell gives a foreground job: killpg(SIGINT) is a terminal's Ctrl-C.
    return subprocess.Popen(cli, cwd=repo, env={**os.environ, **env}, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)


def wait_for_checkpoint(repo: Path, proc: subprocess.Popen, timeout_s: float = 600) -> None:
    ckpts = repo / "checkpoints" / "grpo"
    deadline = time.time() + timeout_s
    while time.time() < deadline and proc.poll() is None:
        if ckpts.exists() and any(p.name.startswith("step-") for p in ckpts.iterdir()):
            time.sleep(0.5)  # well inside GRPO, past the first checkpoint
            return
        time.sleep(0.1)
    tail = proc.communicate()[0][-3000:] if proc.poll() is not None else ""
    raise AssertionError("GRPO wrote no checkpoint: " + tail)


def flow_run_states(prefect_home: Path) -> list[tuple[str, str]]:
    db = sqlite3.connect(prefect_home / "prefect.db")
    return db.execute("SELECT state_type, state_name FROM flow_run").fetchall()


def signal_every_process(pid: int, sig: int) -> None:
    """`sig` to a process and all its descendants at once, as systemd stops a service (every process of its
    cgroup) and `pkill -f grpo-pipeline` stops a run (the CLI and the temporary API forked from it)."""
    import psutil

    root = psutil.Process(pid)
    for process in [root, *root.children(recursive=True)]:
        try:
            process.send_signal(sig)
        except psutil.Error:  # gone since it was listed
            pass


@pytest.mark.parametrize("how", ["SIGTERM", "SIGTERM to every process", "Ctrl-C"])
def test_a_signal_during_grpo_stops_cleanly_and_the_rerun_resumes(tmp_path, how, prefect_home, stage_server):
    repo = copy_committed_project(tmp_path / "repo")
    env = {"MLFLOW_TRACKING_URI": f"sqlite:///{repo / 'mlflow.db'}",
           "PREFECT_HOME": prefect_home(tmp_path / "prefect-home")}
    proc = start_run(repo, env)
    wait_for_checkpoint(repo, proc)
    sent = time.time()
    if how == "SIGTERM":
        proc.send_signal(signal.SIGTERM)  # a scheduler's stop: to the CLI alone
    elif how == "SIGTERM to every process":
        signal_every_process(proc.pid, signal.SIGTERM)
    else:
        os.killpg(proc.pid, signal.SIGINT)  # the terminal's: to the whole foreground group
    output = proc.communicate(timeout=120)[0]
    stopped_in = time.time() - sent
    print(f"{how}: stopped in {stopped_in:.1f} s")
    assert proc.returncode == (130 if how == "Ctrl-C" else 143), output[-3000:]
    assert stopped_in < 20, f"took {stopped_in:.1f} s to stop"  # measured ~2-4 s; the bar is 10 s
    line = re.search(r"interrupted during grpo at step (\d+) of 40; the last checkpoint is step (\d+) "
                     rf"\({'SIGINT' if how == 'Ctrl-C' else 'SIGTERM'}\); rerun to resume", output)
    assert line, output[-3000:]
    assert int(line.group(2)) % 5 == 0 and int(line.group(2)) <= int(line.group(1))  # = : stopped just after it
    assert output.count("interrupted during grpo") <= 2  # the stage's line in Prefect's log, and the CLI's
    for noise in ("Traceback", "websocket", "Connection refused", "KeyboardInterrupt"):
        assert noise not in output, f"{noise!r} in:\n{output[-3000:]}"
    assert not (repo / "models" / "grpo").exists()  # nothing half-written
    assert flow_run_states(tmp_path / "prefect-home") == [("CANCELLED", "Cancelled")]

    if how == "SIGTERM":  # the rerun picks up at the last checkpoint and finishes
        # The failed run's --set overrides were not kept (params.yaml is as before): rerun the same command (on the
        # worker's stage server: the stopped run's own is gone with it).
        from components.runtime.stage_server import SERVER_ENV

        rerun = run([str(BIN / "grpo-pipeline"), "run"] + [x for o in LONG_GRPO for x in ("--set", o)], repo,
                    env={**env, SERVER_ENV: stage_server[1]})
        assert f"resumed from checkpoints/grpo/step-{int(line.group(2)):07d}" in rerun.stdout, (
            output[-2000:] + "\n--- rerun ---\n" + rerun.stdout[-4000:])
        assert "registered model: models:/grpo-addition/1" in rerun.stdout
