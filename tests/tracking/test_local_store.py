"""The local SQLite store is created whole or not at all (components/tracking/local_store.py): a process killed while
MLflow built it must not block every later run."""

from __future__ import annotations

import hashlib
import inspect
import os
import subprocess
import sys
import textwrap

import pytest

from components.tracking import local_store
from components.tracking.local_store import ensure_complete

# Real MLflow building a store, killed (os._exit: no clean-up, as SIGKILL) right after one migration created the
# evaluation_datasets table and before it stamped its revision: the state a kill in CI left.
_KILLED_WHILE_BUILDING = textwrap.dedent("""
    import os, sys
    from sqlalchemy import event
    from sqlalchemy.engine import Engine

    @event.listens_for(Engine, "after_cursor_execute")
    def _die(conn, cursor, statement, *args):
        if "CREATE TABLE evaluation_datasets" in statement:
            os._exit(9)

    from mlflow.tracking import MlflowClient
    MlflowClient(f"sqlite:///{sys.argv[1]}").search_experiments()
""")


@pytest.fixture(autouse=True)
def _unchecked(monkeypatch):
    monkeypatch.setattr(local_store, "_CHECKED", set())


def _half_built(db) -> None:
    killed = subprocess.run([sys.executable, "-c", _KILLED_WHILE_BUILDING, str(db)], capture_output=True)
    assert killed.returncode == 9 and db.exists()


def test_a_store_half_built_by_a_killed_process_is_built_again_and_opens(tmp_path):
    from mlflow.tracking import MlflowClient

    db = tmp_path / "mlflow.db"
    _half_built(db)
    opened = subprocess.run([sys.executable, "-c", "import sys; from mlflow.tracking import MlflowClient; "
                             "MlflowClient(f'sqlite:///{sys.argv[1]}').search_experiments()", str(db)],
                            capture_output=True, text=True)
    assert opened.returncode != 0 and "already exists" in opened.stderr  # what MLflow alone does with it
    said = []
    ensure_complete(f"sqlite:///{db}", say=said.append)
    assert said == ["tracking: mlflow.db had been left half-created by a killed process (it held no runs); "
                    "created it again"]
    client = MlflowClient(f"sqlite:///{db}")
    run = client.create_run(client.create_experiment("after-a-kill"))
    assert client.get_run(run.info.run_id).info.status == "RUNNING"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mlflow.db"]


def test_a_missing_store_is_created_whole_and_a_dead_process_scratch_is_removed(tmp_path):
    db = tmp_path / "sub" / "mlflow.db"
    db.parent.mkdir()
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (db.parent / f"mlflow.db{local_store.SCRATCH_PREFIX}{dead.pid}").write_bytes(b"half")
    building = db.parent / f"mlflow.db{local_store.SCRATCH_PREFIX}{os.getppid()}"  # a live process's, left alone
    building.write_bytes(b"being built")
    said = []
    ensure_complete(f"sqlite:///{db}", say=said.append)
    assert said == [] and sorted(p.name for p in db.parent.iterdir()) == sorted(["mlflow.db", building.name])
    assert local_store._state(db) == (local_store._schema_head(), 0)


def test_a_store_with_runs_in_it_is_never_rebuilt(tmp_path):
    from mlflow.tracking import MlflowClient

    db = tmp_path / "mlflow.db"
    client = MlflowClient(f"sqlite:///{db}")
    client.create_run(client.create_experiment("kept"))
    with __import__("sqlite3").connect(db) as con:  # as if an older MLflow had written it
        con.execute("UPDATE alembic_version SET version_num = 'older'")
    before = hashlib.md5(db.read_bytes()).hexdigest()
    said = []
    ensure_complete(f"sqlite:///{db}", say=said.append)
    assert said == [] and hashlib.md5(db.read_bytes()).hexdigest() == before


def test_only_sqlite_files_are_handled():
    assert local_store.sqlite_path("sqlite:////abs/mlflow.db").as_posix() == "/abs/mlflow.db"
    assert local_store.sqlite_path("sqlite:///rel.db").as_posix() == "rel.db"
    for other in ("http://127.0.0.1:5000", "file:///tmp/mlruns", "postgresql://u@h/db", "sqlite:///:memory:"):
        assert local_store.sqlite_path(other) is None


def test_stores_after_the_first_are_copies_of_one_empty_store_that_is_checked_before_each_use(tmp_path, monkeypatch):
    """MLflow's migrations run once per cache folder and schema: later stores are copies that MLflow opens and writes
    like its own; a template that is not empty (or not at the head) is built again, never copied."""
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    migrations = []
    migrate = local_store._migrate
    monkeypatch.setattr(local_store, "_migrate", lambda path: migrations.append(path.name) or migrate(path))
    template = tmp_path / "cache" / "grpo-pipeline" / f"mlflow-empty-{local_store._schema_head()}.db"
    for name in ("a", "b"):
        ensure_complete(f"sqlite:///{tmp_path / name / 'mlflow.db'}")
    assert len(migrations) == 1 and template.exists()
    client = MlflowClient(f"sqlite:///{tmp_path / 'b' / 'mlflow.db'}")
    run = client.create_run(client.create_experiment("in-a-copy"))
    client.log_metric(run.info.run_id, "reward", 0.5)
    assert client.get_run(run.info.run_id).data.metrics == {"reward": 0.5}
    assert local_store._state(template) == (local_store._schema_head(), 0)  # the copy's run is not in the template

    held = MlflowClient(f"sqlite:///{template}")  # a template that somehow holds a run
    held.create_run(held.create_experiment("not-empty"))
    ensure_complete(f"sqlite:///{tmp_path / 'c' / 'mlflow.db'}")
    assert len(migrations) == 2 and local_store._state(tmp_path / "c" / "mlflow.db")[1] == 0
    assert local_store._state(template) == (local_store._schema_head(), 0)


def test_the_schema_head_is_read_from_mlflows_scripts_once_per_process(monkeypatch):
    """After `remember_schema_head` (the stage server calls it before forking its stages), MLflow's own question for
    its schema head (asked each time a process opens a SQL store) is answered without reading the migration scripts
    again, with the head they gave."""
    from alembic.script import ScriptDirectory
    from mlflow.store.db import utils

    # MLflow's function as it came (a stage run in this process may have remembered it already), put back after
    monkeypatch.setattr(utils, "_get_latest_schema_revision", inspect.unwrap(utils._get_latest_schema_revision))
    head = utils._get_latest_schema_revision()
    reads = []
    from_config = ScriptDirectory.from_config
    monkeypatch.setattr(ScriptDirectory, "from_config", lambda config: reads.append(config) or from_config(config))
    local_store.remember_schema_head()
    assert len(reads) == 1
    assert utils._get_latest_schema_revision() == local_store._schema_head() == head
    local_store.remember_schema_head()
    assert len(reads) == 1  # every later question answered from memory
