"""Tracking that survives an outage of the MLflow tracking server.

While the server does not answer, a run writes what it would have logged (metrics, params, tags, artifacts,
tables, checkpoint models, its end) to an on-disk queue and goes on training; the queue is sent, in order,
when the server answers again: within the run (tried every `GRPO_TRACKING_RETRY_S`, 30 s by default) or at
the next run's start. Runs created during the outage get a local id (`offline-...`) that the queue maps to
the server's id when it is sent, also where another run names it (a stage's `mlflow.parentRunId`).

One queue per repository (`.tracking-outbox/`): stages run one after another, each appending whole lines,
so the order on disk is the order of the calls. Only a remote store (http/https) goes offline; a local
SQLite store has no outage to wait out.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import shutil
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

OUTBOX_DIR = ".tracking-outbox"
OUTBOX_ENV = "GRPO_TRACKING_OUTBOX"
RETRY_ENV = "GRPO_TRACKING_RETRY_S"
OFFLINE_PREFIX = "offline-"


class TrackingUnreachable(ConnectionError):
    """Raised by the project's tracking code itself when the tracking server did not answer (its start-up check, an
    outage's queue that could not be sent): an outage by its type, wherever it is caught."""


def _connection_failures() -> tuple[type[BaseException], ...]:
    """The exception types a failed connection is raised as: the standard library's, urllib3's and requests' (which
    MLflow's client uses; it raises them wrapped in an MlflowException, chained)."""
    import requests
    import urllib3

    return (ConnectionError, TimeoutError, requests.exceptions.ConnectionError, requests.exceptions.Timeout,
            requests.exceptions.RetryError, requests.exceptions.ChunkedEncodingError,
            urllib3.exceptions.MaxRetryError, urllib3.exceptions.NewConnectionError, urllib3.exceptions.ProtocolError)


def is_outage(err: BaseException | None) -> bool:
    """A failed connection, known by its type anywhere in the chain (however MLflow or requests wrap it): a server
    that did not answer, refused, reset or timed out, or answered 5xx until the bounded retries were spent."""
    kinds, seen = _connection_failures(), 0
    while err is not None and seen < 10:
        if isinstance(err, kinds):
            return True
        err, seen = err.__cause__ or err.__context__, seen + 1
    return False


_USER_CODE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "user_code.py")


def _tracking_code() -> tuple[str, ...]:
    """The folders of the code that talks to the tracking server: this package, and MLflow's once imported."""
    import sys

    folders = [os.path.dirname(os.path.abspath(__file__)) + os.sep]
    mlflow = sys.modules.get("mlflow")
    if mlflow is not None and getattr(mlflow, "__file__", None):
        folders.append(os.path.dirname(os.path.abspath(mlflow.__file__)) + os.sep)
    return tuple(folders)


def raised_by_tracking_client(err: BaseException) -> bool:
    """Where the error was raised: inside MLflow's client or the project's tracking code (components/tracking), and
    not inside a call of the user's code (components/user_code.py: a reward, tool or environment that talks to a
    server of its own, or raises `ConnectionError` itself, is the user's failure, never the pipeline's outage)."""
    import traceback

    files = [os.path.abspath(frame.f_code.co_filename) for frame, _ in traceback.walk_tb(err.__traceback__)]
    return any(f.startswith(_tracking_code()) for f in files) and _USER_CODE not in files


def tracking_outage(err: BaseException) -> bool:
    """The pipeline's own connection to its tracking server failed: a connection failure (by type) raised where the
    pipeline talks to MLflow (by where), never a failure of the user's code whatever its text says."""
    if isinstance(err, TrackingUnreachable):
        return True
    return is_outage(err) and raised_by_tracking_client(err)


def is_remote(uri: str) -> bool:
    return uri.startswith(("http://", "https://"))


def answers(uri: str, timeout_s: float = 2.0) -> bool:
    """The server answers its health check now (one try, no retries: a probe, not a request)."""
    import requests

    try:
        return requests.get(f"{uri.rstrip('/')}/health", timeout=timeout_s).ok
    except requests.RequestException:
        return False


def retry_every_s() -> float:
    return float(os.environ.get(RETRY_ENV, "30"))


def local_id() -> str:
    return OFFLINE_PREFIX + uuid.uuid4().hex


def quiet_http_logs(log_file: Path) -> None:
    """urllib3's retry warnings go to `log_file`, not the terminal: the outage gets one line of our own."""
    logger = logging.getLogger("urllib3")
    if any(getattr(h, "_grpo_outbox", False) for h in logger.handlers):
        return
    log_file.parent.mkdir(parents=True, exist_ok=True)
    handler = logging.FileHandler(log_file)
    handler._grpo_outbox = True  # type: ignore[attr-defined]
    handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s %(message)s"))
    logger.addHandler(handler)
    logger.propagate = False


class Outbox:
    """The on-disk queue: `queue.jsonl` (one operation a line), `sent` (how many are done), `ids.json`
    (local id -> server id) and `files/` (copies of queued artifacts, so later changes do not alter them)."""

    def __init__(self, root: Path | None = None):
        from components.data.paths import repository_root

        self.root = Path(root or os.environ.get(OUTBOX_ENV) or repository_root() / OUTBOX_DIR)
        self.queue, self.sent_file, self.ids_file = (self.root / "queue.jsonl", self.root / "sent",
                                                     self.root / "ids.json")

    def announce_outage(self, run_key: str | None) -> bool:
        """Whether this process should say that the server is away: once per pipeline run (`run_key`, its MLflow
        parent run; stages are processes of their own), until the outage ends; without a key, each time asked."""
        said = self.root / "outage-said"
        if run_key and said.exists() and said.read_text() == run_key:
            return False
        if run_key:
            self.root.mkdir(parents=True, exist_ok=True)
            said.write_text(run_key)
        return True

    def outage_ended(self) -> None:
        """The server answers again (its queue was sent, which is said once): the next outage is said again."""
        (self.root / "outage-said").unlink(missing_ok=True)

    def pending(self) -> int:
        if not self.queue.exists():
            return 0
        with self.queue.open("rb") as fh:
            total = sum(1 for _ in fh)
        return total - self._sent()

    def ids(self) -> dict[str, str]:
        try:
            ids = json.loads(self.ids_file.read_text()) if self.ids_file.exists() else {}
        except (OSError, ValueError):  # written in one rename since; an older version's, cut short by a kill
            return {}
        return ids if isinstance(ids, dict) else {}

    def resolve(self, some_id: str | None) -> str | None:
        """The server's id for a local one once it was sent; any other id unchanged."""
        return self.ids().get(some_id, some_id) if some_id and some_id.startswith(OFFLINE_PREFIX) else some_id

    @contextlib.contextmanager
    def _held(self) -> Iterator[None]:
        """The queue to this process alone while it appends or sends (a kernel lock: it dies with its holder), so a
        line cut short is known to be a dead writer's, never one a live process is still writing."""
        self.root.mkdir(parents=True, exist_ok=True)
        with open(self.root / "queue.lock", "a") as fh:
            fcntl.flock(fh, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(fh, fcntl.LOCK_UN)

    def add(self, op: dict[str, Any]) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        if op.get("file"):  # keep the artifact as it is now
            copy = self.root / "files" / uuid.uuid4().hex / Path(op["file"]).name
            copy.parent.mkdir(parents=True)
            (shutil.copytree if Path(op["file"]).is_dir() else shutil.copy2)(op["file"], copy)
            op = {**op, "file": str(copy)}
        line = (json.dumps(op, default=str) + "\n").encode()
        with self._held(), self.queue.open("ab+") as fh:
            fh.seek(0, os.SEEK_END)
            if fh.tell():
                fh.seek(-1, os.SEEK_END)
                if fh.read(1) != b"\n":  # a line a killed writer cut short stays a line of its own (skipped)
                    line = b"\n" + line
            fh.write(line)
            fh.flush()
            os.fsync(fh.fileno())

    def send(self, client) -> int:
        """Send every queued operation in order (resuming after the last one sent); clear the queue when all
        went. Raises what the client raises (the caller decides whether it is an outage). A line a kill cut short
        (never complete, so never acknowledged) is skipped and said in one line."""
        if not self.queue.exists():
            return 0
        from components.data.records import write_text_atomic

        with self._held():
            lines = [line for line in self.queue.read_bytes().split(b"\n") if line.strip()]
            done, ids, cut = self._sent(), self.ids(), 0
            for i in range(done, len(lines)):
                try:
                    op = json.loads(lines[i])
                except ValueError:
                    cut += 1
                    continue
                apply_op(client, op, ids)
                write_text_atomic(self.ids_file, json.dumps(ids))
                write_text_atomic(self.sent_file, str(i + 1))
            if cut:
                print(f"tracking: skipped {cut} queued record{'s' if cut > 1 else ''} a kill cut short while it was "
                      "written (never complete, so never sent)", flush=True)
            # The ids stay: a later run may still name a run created offline (a stage's parent).
            self.queue.unlink()
            self.sent_file.unlink(missing_ok=True)
            shutil.rmtree(self.root / "files", ignore_errors=True)
        return len(lines) - done - cut

    def _sent(self) -> int:
        try:
            return int(self.sent_file.read_text() or 0) if self.sent_file.exists() else 0
        except (OSError, ValueError):  # written in one rename since; an older version's, cut short by a kill
            return 0


def _mapped(value: Any, ids: dict[str, str]) -> Any:
    if isinstance(value, str) and value.startswith(OFFLINE_PREFIX):
        return ids.get(value, value)
    if isinstance(value, dict):
        return {k: _mapped(v, ids) for k, v in value.items()}
    if isinstance(value, list):
        return [_mapped(v, ids) for v in value]
    return value


def apply_op(client, op: dict[str, Any], ids: dict[str, str]) -> None:
    """Do one queued operation against the server (`ids` gains the server ids of what it creates)."""
    from mlflow.entities import Metric, Param, RunTag

    op = {k: (v if k == "id" else _mapped(v, ids)) for k, v in op.items()}
    kind, run = op["op"], op.get("run")
    if kind == "create_run":
        experiment = client.get_experiment_by_name(op["experiment"])
        created = client.create_run(experiment.experiment_id if experiment else client.create_experiment(
            op["experiment"]), start_time=op["time"], tags=op["tags"], run_name=op["tags"].get("mlflow.runName"))
        ids[op["id"]] = created.info.run_id
    elif kind == "log_batch":
        client.log_batch(run, metrics=[Metric(k, v, t, s) for k, v, t, s in op.get("metrics", [])],
                         params=[Param(k, v) for k, v in op.get("params", [])],
                         tags=[RunTag(k, v) for k, v in op.get("tags", [])])
    elif kind == "terminate":
        client.set_terminated(run, status=op["status"], end_time=op["time"])
    elif kind == "artifact":
        (client.log_artifacts if Path(op["file"]).is_dir() else client.log_artifact)(run, op["file"],
                                                                                      op.get("artifact_path"))
    elif kind == "table":
        import pandas as pd

        client.log_table(run, data=pd.DataFrame(op["rows"]), artifact_file=op["artifact_file"])
    elif kind == "text":
        client.log_text(run, op["text"], op["artifact_file"])
    elif kind == "checkpoint_model":
        ids[op["id"]] = create_checkpoint_model(client, run, op["name"], op["step"], op["metrics"], op["tags"],
                                                op["time"])
    elif kind == "model_tags":
        client.set_logged_model_tags(op["model"], op["tags"])
    else:
        raise ValueError(f"unknown queued tracking operation {kind!r}")


def create_checkpoint_model(client, run_id: str, name: str, step: int, metrics: dict[str, float],
                            tags: dict[str, str], timestamp_ms: int | None = None) -> str:
    """One training checkpoint as an MLflow LoggedModel carrying its step and held-out metrics."""
    from mlflow.entities import Metric

    experiment = client.get_run(run_id).info.experiment_id
    model = client.create_logged_model(experiment, name=name, source_run_id=run_id, tags=tags,
                                       params={"step": str(step)})
    now = timestamp_ms or int(time.time() * 1000)
    client.log_batch(run_id, metrics=[Metric(k, float(v), now, step, model_id=model.model_id, run_id=run_id)
                                      for k, v in metrics.items() if v == v])
    client.finalize_logged_model(model.model_id, "READY")
    return model.model_id
