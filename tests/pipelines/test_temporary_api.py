"""The run's temporary Prefect API (pipelines/warmup.py): forked from the CLI, or a fresh interpreter.

Each case runs in its own interpreter (pytest's has threads of its own) with a fresh PREFECT_HOME,
starts the real API and runs a real flow against it.
"""

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request

import pytest

from components.locks import LockBusy, file_lock

from conftest import BIN, ROOT, copy_committed_project, run

pytestmark = pytest.mark.integration

SCRIPT = r"""
import json, os, sys, threading, urllib.request
from pipelines import warmup

api = warmup.plan_prefect_api()
import prefect  # the CLI imports Prefect, then starts the API (pipelines/commands/run_flow.py)
from prefect import flow

if sys.argv[1] == "with-thread":  # e.g. Prefect's first-import telemetry thread in a terminal
    stop = threading.Event()
    threading.Thread(target=stop.wait, daemon=True).start()
api.start()
kind = type(api.process).__name__
api.wait_ready()

@flow(name="temporary-api-check")
def answer() -> int:
    return 42

result = answer()
from prefect.client.orchestration import get_client
with get_client(sync_client=True) as client:
    runs = client.read_flow_runs()
print(json.dumps({"kind": kind, "url": api.url, "pid": api.process.pid, "result": result,
                  "runs": [(r.name, r.state_type.value) for r in runs]}), flush=True)
if sys.argv[1] == "hold":  # hold the run lock, then wait to be killed
    sys.stdin.readline()
api.stop()
print(json.dumps({"returncode": api.process.returncode}), flush=True)
"""


def run_script(tmp_path, mode: str, **popen) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}
    env.update(PREFECT_HOME=str(tmp_path / "prefect-home"), PREFECT_SERVER_ANALYTICS_ENABLED="false",
               PYTHONPATH=str(ROOT))
    return subprocess.Popen([sys.executable, "-c", SCRIPT, mode], cwd=ROOT, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, **popen)


def answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=2) as response:
            return response.status == 200
    except OSError:
        return False


@pytest.mark.parametrize("mode,kind", [("plain", "ForkedServer"), ("with-thread", "Popen")])
def test_api_serves_a_flow_and_stops(tmp_path, mode, kind):
    """Forked from the CLI when it runs no other thread; a fresh interpreter when one runs."""
    proc = run_script(tmp_path, mode)
    out, err = proc.communicate(timeout=240)
    assert proc.returncode == 0, err[-3000:]
    started, stopped = (json.loads(line) for line in out.strip().splitlines()[-2:])
    assert started["kind"] == kind
    assert started["result"] == 42
    assert started["runs"] == [[started["runs"][0][0], "COMPLETED"]]  # recorded by this API, in this home
    assert stopped["returncode"] in (0, -signal.SIGINT)  # stopped by the CLI's SIGINT (it ignores SIGTERM)
    assert not answers(started["url"])


@pytest.mark.own_stage_server  # the killed CLI's own stage server goes with it
def test_forked_api_dies_with_a_killed_cli_and_frees_the_run_lock(tmp_path):
    """The forked API inherits the CLI's run lock (flock); it must not keep it after the CLI is SIGKILLed."""
    lock = tmp_path / "run.lock"
    holder = (
        "import sys\n"
        "from components.locks import file_lock\n"
        f"with file_lock(__import__('pathlib').Path({str(lock)!r}), 'test run'):\n"
        "    exec(compile(sys.argv[2], 'script', 'exec'))\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}
    env.update(PREFECT_HOME=str(tmp_path / "prefect-home"), PREFECT_SERVER_ANALYTICS_ENABLED="false")
    proc = subprocess.Popen([sys.executable, "-c", holder, "hold", SCRIPT], cwd=ROOT, env=env, text=True,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    started = json.loads(proc.stdout.readline())
    assert started["kind"] == "ForkedServer" and answers(started["url"])
    with pytest.raises(LockBusy):
        with file_lock(lock, "test run"):
            pass
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    try:
        with file_lock(lock, "test run", wait_s=30):  # free once the API has followed the CLI
            pass
        deadline = time.monotonic() + 30
        while answers(started["url"]) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not answers(started["url"])
    finally:
        with contextlib.suppress(ProcessLookupError):  # an API that outlived the CLI: not left behind
            os.kill(started["pid"], signal.SIGKILL)


def test_a_connection_reset_cut_short_by_the_apis_shutdown_is_not_reported():
    """SQLAlchemy's "Exception during reset" with the shutdown's CancelledError is dropped (a SIGTERM'd run printed
    it as a traceback); the same error from elsewhere, and any other error of the pool, still reaches the console."""
    import asyncio
    import logging
    import sys

    from pipelines.warmup import ShutdownResets, quiet_shutdown_resets

    def record(name: str, error: BaseException) -> logging.LogRecord:
        try:
            raise error
        except BaseException:  # noqa: BLE001 - the record carries whatever was raised
            return logging.LogRecord(name, logging.ERROR, __file__, 1, "Exception during reset or similar", None,
                                     sys.exc_info())

    pool = "sqlalchemy.pool.impl.AsyncAdaptedQueuePool"
    assert not ShutdownResets().filter(record(pool, asyncio.CancelledError()))
    assert ShutdownResets().filter(record(pool, OSError("disk I/O error")))
    assert ShutdownResets().filter(record("prefect.flow_runs", asyncio.CancelledError()))
    quiet_shutdown_resets()  # what the API's process does before it serves: the pool Prefect's SQLite store uses
    assert not logging.getLogger(pool).filter(record(pool, asyncio.CancelledError()))
    assert logging.getLogger(pool).filter(record(pool, OSError("disk I/O error")))


def flow_runs(api: str) -> dict[str, dict]:
    """The flow runs the API at `api` holds, by id: the newest, as many as one answer gives (a run just made among
    them)."""
    body = json.dumps({"sort": "EXPECTED_START_TIME_DESC"}).encode()
    request = urllib.request.Request(f"{api}/flow_runs/filter", data=body,
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as response:
        return {r["id"]: r for r in json.loads(response.read())}


@pytest.mark.slow
def test_a_run_reports_to_the_configured_api_and_starts_none(tmp_path):
    """With PREFECT_API_URL set (here the worker's API, tests/worker_services.py, as a team's Prefect server would be),
    `grpo-pipeline run` records its flow run there and starts no temporary API (one would have made its database in
    the run's Prefect home). The run stops at validate (a blank prompt), failed, as the configured API records it."""
    api = os.environ["PREFECT_API_URL"]
    repo = copy_committed_project(tmp_path / "repo")
    rows = [{"id": f"t{i}", "prompt": f"{i}+1=", "answer": str(i + 1)} for i in range(20)]
    rows[3]["prompt"] = "  "
    for name, part in (("train", rows[:10]), ("heldout", rows[10:])):
        (repo / "data" / "user" / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in part))
    before = flow_runs(api)
    home = tmp_path / "prefect-home"
    proc = run([str(BIN / "grpo-pipeline"), "run", "--set", "data.train_path=data/user/train.jsonl",
                "--set", "data.heldout_path=data/user/heldout.jsonl"], repo, env={"PREFECT_HOME": str(home)},
               check=False)
    assert proc.returncode != 0 and "rule 'prompt not empty or whitespace' failed" in proc.stdout, proc.stdout[-3000:]
    new = [r for run_id, r in flow_runs(api).items() if run_id not in before]
    assert [(r["state_type"], r["parameters"].get("root")) for r in new] == [("FAILED", str(repo))], new
    assert not (home / "prefect.db").exists()
