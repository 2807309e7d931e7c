"""The warm stage interpreter: stages forked from it behave like their own processes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

import pytest

from components.runtime.stage_client import run_remote, server_accepts
from components.runtime.stage_server import SERVER_ENV, start_server, stop_server
from components.stages.cli import STAGE_TIMINGS_ENV

from conftest import run

TINY = ["--set", "task.n_sft=20", "--set", "task.n_train=20", "--set", "task.n_heldout=10"]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from conftest import copy_committed_project

    repo = copy_committed_project(tmp_path_factory.mktemp("served") / "repo")
    proc, path = start_server(str(repo))
    yield repo, path
    stop_server(proc, path)
    assert proc.poll() is not None


def test_a_served_stage_writes_its_outputs_reports_compute_and_relays_exit_codes(server, monkeypatch, tmp_path,
                                                                                  capfd):
    repo, path = server
    monkeypatch.chdir(repo)
    timings = tmp_path / "times.jsonl"
    monkeypatch.setenv(STAGE_TIMINGS_ENV, str(timings))
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{repo / 'mlflow.db'}")
    assert run_remote(path, "prepare", TINY) == 0  # an int, not None: the server ran it
    out = capfd.readouterr()
    assert "prepare: train: from generated:addition" in out.out  # the child wrote to our own stdout
    assert len((repo / "data" / "prepared" / "train.jsonl").read_text().splitlines()) == 20
    recorded = [json.loads(line) for line in timings.read_text().splitlines()]
    assert [r["stage"] for r in recorded] == ["prepare"] and recorded[0]["compute_seconds"] >= 0
    # the level's imports (MLflow, pandas: hundreds of thousands of objects) reach the child frozen,
    # and the child collects its own garbage again
    assert recorded[0]["gc_frozen"] > 100_000 and recorded[0]["gc_enabled"] is True
    assert run_remote(path, "prepare", ["--set", "task.n_sft=-5"]) == 1  # the stage's own exit code
    assert "error:" in capfd.readouterr().err


def test_a_named_server_is_used_only_by_callers_whose_import_settings_it_has(server, monkeypatch, tmp_path):
    """What `grpo-pipeline run` asks before using a server named in GRPO_STAGE_SERVER instead of its own."""
    _, path = server
    assert server_accepts(path)  # this process's environment, as the server was started from it
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")  # read by transformers' import: a forked stage would not see it
    assert not server_accepts(path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))  # another module search path: its modules would not be found
    assert not server_accepts(path)
    assert not server_accepts(str(tmp_path / "no-server.sock")) and not server_accepts(None)


def test_the_launcher_runs_the_stage_itself_when_import_settings_differ(server):
    repo, path = server
    proc = run([sys.executable, "-m", "components.runtime.launch", "prepare", *TINY], repo,
               env={SERVER_ENV: path, "HF_HUB_OFFLINE": "0", "MLFLOW_TRACKING_URI": f"sqlite:///{repo / 'mlflow.db'}"})
    assert "stage server: not used (HF_HUB_OFFLINE differ)" in proc.stdout
    assert "prepare: heldout: from generated:addition" in proc.stdout


def test_the_launcher_without_a_server_is_the_plain_stage(tmp_path):
    from conftest import copy_committed_project

    repo = copy_committed_project(tmp_path / "repo")
    timings = tmp_path / "times.jsonl"
    proc = run([sys.executable, "-m", "components.runtime.launch", "prepare", *TINY], repo,
               env={SERVER_ENV: "", "MLFLOW_TRACKING_URI": f"sqlite:///{repo / 'mlflow.db'}",
                    STAGE_TIMINGS_ENV: str(timings)})
    assert "stage server" not in proc.stdout
    assert (repo / "data" / "prepared" / "heldout.jsonl").exists()
    recorded = json.loads(timings.read_text())
    assert recorded["gc_frozen"] == 0 and recorded["gc_enabled"] is True  # nothing inherited, nothing frozen
    bad = run([sys.executable, "-m", "components.runtime.launch", "nonsense"], repo, check=False)
    assert bad.returncode == 2 and "usage:" in bad.stdout


def test_overhead_breakdown_from_stage_stamps():
    from pipelines.commands.run_report import overhead_breakdown

    # Process start 100.0; stage A entered 110, compute 111..120; stage B entered 121.5, compute 122..130.
    stamps = [{"stage": "a", "entered": 110.0, "started_at": 111.0, "ended_at": 120.0, "compute_seconds": 9.0},
              {"stage": "b", "entered": 121.5, "started_at": 122.0, "ended_at": 130.0, "compute_seconds": 8.0}]
    got = overhead_breakdown(stamps, process_started=100.0)
    assert got["before_first_stage"] == 10.0
    assert got["stage_warm_ups"] == 1.5  # 1.0 + 0.5
    assert got["between_stages"] == 1.5  # 121.5 - 120.0
    assert got["after_last_stage"] > 0  # until now, long after 130.0
    assert overhead_breakdown([{"stage": "old", "compute_seconds": 1.0}], 0.0) == {}  # records without stamps


def test_every_stage_finds_its_warm_up_imports_at_its_own_level():
    """A stage forked from level k must not import anything heavy itself: its warm-up list is in levels <= k."""
    from components.runtime.stage_server import LEVELS, STAGE_MODULES, level_modules, level_of
    from components.stages.cli import HEAVY_IMPORTS, STAGE_IMPORTS

    assert level_of("prepare") == 0 and level_of("parent_run") == 0  # no torch before the first stage
    assert "torch" not in level_modules(0) and "great_expectations" not in level_modules(level_of("model"))
    assert level_of("nonsense") == len(LEVELS) - 1
    # MLflow's schema head is remembered where every stage and job forks from (components/tracking/local_store.py)
    assert "components.tracking.local_store:remember_schema_head" in LEVELS[0][1]
    for stage, module in STAGE_MODULES.items():
        available = level_modules(level_of(stage))
        needed = set(STAGE_IMPORTS.get(stage, HEAVY_IMPORTS)) | {f"components.{module}"}
        assert needed <= available, (stage, needed - available)


def test_levels_serve_prepare_without_torch_and_stop_together(tmp_path, monkeypatch):
    import os
    import subprocess
    import time

    from components.runtime.stage_server import LEVELS, level_path

    from conftest import copy_committed_project

    repo = copy_committed_project(tmp_path / "repo")
    monkeypatch.chdir(repo)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{repo / 'mlflow.db'}")
    proc, path = start_server(str(repo))
    try:
        assert run_remote(path, "prepare", TINY) == 0
        assert (repo / "data" / "prepared" / "train.jsonl").exists()
        with open(f"/proc/{proc.pid}/maps") as maps:  # level 0 served it: torch's library is not even loaded
            assert "libtorch" not in maps.read()
        assert all(os.path.exists(level_path(path, level)) for level in range(len(LEVELS)))
    finally:
        stop_server(proc, path)
    left: list[str] = []
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:  # the later levels (still importing, or serving) exit with level 0
        left = subprocess.run(["pgrep", "-f", path], capture_output=True, text=True).stdout.split()
        if not left:
            break
        time.sleep(0.1)
    assert not left
    assert not any(os.path.exists(level_path(path, level)) for level in range(len(LEVELS)))


def test_great_expectations_is_imported_only_once_new_data_or_validate_asks(tmp_path, monkeypatch):
    """The lazy level (Great Expectations) costs no CPU while the training level imports beside it, and starts
    importing on `prepare`'s hint: a rerun whose data did not change never pays for it."""
    import time

    import psutil

    from components.runtime.stage_server import LAZY_LEVELS, LEVELS, level_of

    from conftest import copy_committed_project

    assert level_of("validate") in LAZY_LEVELS and LEVELS[level_of("sft")][0] == level_of("model")
    repo = copy_committed_project(tmp_path / "repo")
    monkeypatch.chdir(repo)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{repo / 'mlflow.db'}")
    proc, path = start_server(str(repo))

    def cpu(process: psutil.Process) -> float:
        times = process.cpu_times()
        return times.user + times.system

    try:
        assert run_remote(path, "register", ["--help"]) == 0  # served by the training level: its imports are done
        (model_level,) = psutil.Process(proc.pid).children()
        children = model_level.children()
        waiting = [c for c in children if cpu(c) < 0.1]
        assert len(children) == 2 and len(waiting) == 1, [(c.pid, cpu(c)) for c in children]
        deadline = time.monotonic() + 120
        assert run_remote(path, "prepare", TINY) == 0  # new data: its request first wakes the lazy level
        while cpu(waiting[0]) < 1.0 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert cpu(waiting[0]) >= 1.0  # woken: importing Great Expectations
    finally:
        stop_server(proc, path)


def test_imports_without_collection_freezes_what_it_imported_and_restores_the_collector():
    import gc

    from components.runtime.stage_server import imports_without_collection

    gc.unfreeze()
    try:
        with imports_without_collection():
            assert not gc.isenabled()
            kept = [[i] for i in range(5000)]  # stands in for an import's long-lived objects
        assert gc.isenabled() and gc.get_freeze_count() >= len(kept)
        gc.disable()
        with imports_without_collection():
            pass
        assert not gc.isenabled()  # a collector that was off stays off
    finally:
        gc.enable()
        gc.unfreeze()


def test_a_new_server_removes_the_sockets_of_servers_whose_owner_died():
    """A run killed with SIGKILL leaves its server's level sockets in the temporary directory; the next server
    started removes those of owners that are gone and keeps those of owners alive."""
    gone = subprocess.Popen(["true"])
    gone.wait()  # its pid names an owner that is gone
    folder = tempfile.gettempdir()
    left = [os.path.join(folder, f"grpo-stages-{gone.pid}-1.sock{level}") for level in ("", ".1", ".3")]
    alive = os.path.join(folder, f"grpo-stages-{os.getpid()}-1.sock")
    for path in [*left, alive]:
        open(path, "w").close()
    try:
        proc, path = start_server(os.getcwd())
        stop_server(proc, path)
        assert not any(os.path.exists(p) for p in left)
        assert os.path.exists(alive)
    finally:
        for p in [*left, alive]:
            if os.path.exists(p):
                os.unlink(p)
