"""The local SQLite tracking store, created whole or not at all.

MLflow builds a new SQLite store in place: it creates the first tables, then runs a few dozen schema migrations, each
committed on its own. A process killed in between leaves a store that every later open fails on ("table ... already
exists"), so one unlucky kill would block every rerun. Here a missing store is built in a scratch file beside it and
linked into place only once complete; a store found half-built (its schema short of MLflow's head and no run or
registered model in it, so it holds nothing) is built again the same way. A store with runs in it is never touched.
"""

from __future__ import annotations

import contextlib
import functools
import os
import shutil
import sqlite3
from pathlib import Path

_CHECKED: set[Path] = set()
SCRATCH_PREFIX = ".creating-"


def sqlite_path(uri: str) -> Path | None:
    """The file of a `sqlite:///` tracking URI; None for any other store (a server, a folder, a database server)."""
    prefix = "sqlite:///"
    if not uri.startswith(prefix):
        return None
    rest = uri[len(prefix):].split("?", 1)[0]
    if not rest or rest == ":memory:":
        return None
    return Path(rest)


def _schema_head() -> str:
    remember_schema_head()
    from mlflow.store.db import utils

    return utils._get_latest_schema_revision()


def remember_schema_head() -> None:
    """MLflow finds its schema head by reading its migration scripts (dozens of files) each time it is asked: once
    here per process and store, and again each time a process opens a SQL store (`_verify_schema`), a few times per
    stage. The head cannot change while a process lives, so the first answer is kept for every later question. The
    stage server asks once before it forks (components/runtime/stage_server.py), so its stages inherit the answer.
    Where MLflow has no such function, nothing changes."""
    from mlflow.store.db import utils

    head = getattr(utils, "_get_latest_schema_revision", None)
    if head is None:
        return
    if not hasattr(head, "cache_info"):
        utils._get_latest_schema_revision = functools.cache(head)
    utils._get_latest_schema_revision()


def _state(db: Path) -> tuple[str | None, int]:
    """(its schema revision or None, how many runs and registered models it holds)."""
    # Opened for writing: a rollback journal left by the killed process is rolled back first, as SQLite does.
    with contextlib.closing(sqlite3.connect(db, timeout=30)) as con:
        tables = {name for (name,) in con.execute("SELECT name FROM sqlite_master WHERE type='table'")}
        revision = None
        if "alembic_version" in tables:
            row = con.execute("SELECT version_num FROM alembic_version").fetchone()
            revision = row[0] if row else None
        held = sum(con.execute(f"SELECT COUNT(*) FROM {t}").fetchone()[0]  # fixed table names
                   for t in ("runs", "registered_models") if t in tables)
    return revision, held


def _migrate(scratch: Path) -> None:
    """MLflow's own tables and migrations, into the new file `scratch` (seconds)."""
    from mlflow.store.db.utils import _initialize_tables, create_sqlalchemy_engine_with_retry

    engine = create_sqlalchemy_engine_with_retry(f"sqlite:///{scratch}")
    try:
        _initialize_tables(engine)
    finally:
        engine.dispose()


def _template_dir() -> Path:
    """Where the empty store is kept: `$XDG_CACHE_HOME/grpo-pipeline`, else `~/.cache/grpo-pipeline`."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "grpo-pipeline"


def _empty_store(head: str) -> Path | None:
    """An empty store at MLflow's schema `head`, migrated once per machine and schema and then copied: an empty store
    holds only the schema and MLflow's default workspace row, nothing of where it lives. Checked before each use
    (its revision is `head`, no run or model in it); None where it cannot be built or read (MLflow migrates then)."""
    template = _template_dir() / f"mlflow-empty-{head}.db"
    try:
        if not (template.exists() and _state(template) == (head, 0)):
            template.parent.mkdir(parents=True, exist_ok=True)
            _remove_stale_scratch(template)
            scratch = template.with_name(f"{template.name}{SCRATCH_PREFIX}{os.getpid()}")
            scratch.unlink(missing_ok=True)
            _migrate(scratch)
            os.replace(scratch, template)  # whole or not at all, as below
            if _state(template) != (head, 0):
                return None
        return template
    except (OSError, sqlite3.Error):
        return None


def _build(db: Path) -> Path:
    """A complete store in a scratch file beside `db` (the same file system, so it can be linked into place): a copy
    of the empty store (milliseconds), or MLflow's migrations where that cannot be had."""
    scratch = db.with_name(f"{db.name}{SCRATCH_PREFIX}{os.getpid()}")
    scratch.unlink(missing_ok=True)
    template = _empty_store(_schema_head())
    if template is not None:
        shutil.copyfile(template, scratch)
    else:
        _migrate(scratch)
    return scratch


def _remove_stale_scratch(db: Path) -> None:
    """Scratch stores of processes that no longer run (killed while building one; a pid reused since is not theirs)."""
    from components.run_marker import pid_alive

    for scratch in db.parent.glob(f"{db.name}{SCRATCH_PREFIX}*"):
        pid = scratch.name.rsplit("-", 1)[-1]
        if pid.isdigit() and not pid_alive(int(pid), scratch.stat().st_mtime):
            scratch.unlink(missing_ok=True)


def ensure_complete(uri: str, say=print) -> None:
    """Make the SQLite store at `uri` exist whole before MLflow opens it; any other kind of store is left to MLflow.

    Costs one read of the store's schema revision per process and file; building a store costs a file copy (MLflow's
    own migrations, seconds, once per machine and MLflow schema: `_empty_store`)."""
    db = sqlite_path(uri)
    if db is None:
        return
    db = db.resolve()
    if db in _CHECKED:
        return
    db.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_scratch(db)
    if db.exists() and db.stat().st_size > 0:
        revision, held = _state(db)
        if revision == _schema_head() or held:
            _CHECKED.add(db)
            return  # complete, or holds runs: an older schema is MLflow's to upgrade or refuse
        scratch = _build(db)
        os.replace(scratch, db)
        Path(f"{db}-journal").unlink(missing_ok=True)
        say(f"tracking: {db.name} had been left half-created by a killed process (it held no runs); created it again")
    else:
        scratch = _build(db)
        with contextlib.suppress(FileExistsError):  # another process linked its complete store first: keep that one
            if db.exists():  # an empty file (touched, never written): replace it
                os.replace(scratch, db)
            else:
                os.link(scratch, db)
        scratch.unlink(missing_ok=True)
    _CHECKED.add(db)
