"""MLflow runs addressed by explicit run ids (the fluent active run is thread-local).

A pipeline run owns one parent run; each stage opens a nested child of the run id found in
`GRPO_PARENT_RUN_ID`, or a standalone run when a stage is launched on its own (plain `dvc repro`).
"""

from __future__ import annotations

import contextlib
import os
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from components.interruptions import deferred

PARENT_RUN_ENV = "GRPO_PARENT_RUN_ID"
# Whole name parts (split on . _ - and case changes), so MLFLOW_TRACKING_TOKEN, api_token and
# AWS_SECRET_ACCESS_KEY match while max_new_tokens (a token count, not a token) does not.
_SECRET_WORDS = {"token", "secret", "password", "passwd", "credential", "credentials", "apikey"}
_SECRET_PAIRS = {("api", "key"), ("access", "key"), ("private", "key"), ("secret", "key")}


def tracking_uri(root: Path = Path(".")) -> str:
    """`MLFLOW_TRACKING_URI` when set, else the SQLite store `mlflow.db` at the repository root (the repository's
    own in a DVC experiment run in a temporary copy: components/data/paths.py `repository_root`)."""
    from components.data.paths import repository_root

    return os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{(repository_root(root) / 'mlflow.db').resolve()}"


def is_secret_key(name: str) -> bool:
    """Names that must never be logged (tokens, passwords, cloud keys)."""
    words = [w.lower() for w in re.split(r"[._\-\s]+|(?<=[a-z])(?=[A-Z])", name) if w]
    return any(w in _SECRET_WORDS for w in words) or any(pair in _SECRET_PAIRS for pair in zip(words, words[1:]))


# Bounded retries against a tracking server: about 15 s of backoff, then a clear failure.
RETRY_DEFAULTS = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "4", "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
                  "MLFLOW_HTTP_REQUEST_BACKOFF_JITTER": "0.5", "MLFLOW_HTTP_REQUEST_TIMEOUT": "30"}


def redact(value: Any) -> Any:
    """A copy of nested params with the values of secret-looking keys replaced by '***'."""
    if isinstance(value, dict):
        return {k: "***" if is_secret_key(str(k)) else redact(v) for k, v in value.items()}
    if isinstance(value, list):
        return [redact(v) for v in value]
    return value


def client():
    from components.tracking.outbox import Outbox, is_remote, quiet_http_logs

    for key, value in RETRY_DEFAULTS.items():
        os.environ.setdefault(key, value)
    if is_remote(tracking_uri()):
        quiet_http_logs(Outbox().root / "http.log")
    import mlflow
    from mlflow.tracking import MlflowClient

    from components.tracking.local_store import ensure_complete

    ensure_complete(tracking_uri())
    mlflow.set_tracking_uri(tracking_uri())
    return MlflowClient(tracking_uri=tracking_uri())


def experiment_id(name: str) -> str:
    """The experiment's id, created if missing (two runs starting at once may race: the loser reads it)."""
    from mlflow.exceptions import MlflowException

    c = client()
    exp = c.get_experiment_by_name(name)
    if exp is not None:
        return exp.experiment_id
    try:
        return c.create_experiment(name)
    except MlflowException:
        exp = c.get_experiment_by_name(name)
        if exp is None:
            raise
        return exp.experiment_id


class StageRun:
    """A thin handle over one MLflow run: metrics batched, params stringified, secrets dropped.

    When a remote tracking server stops answering, every call goes to the on-disk queue instead
    (components/tracking/outbox.py), said once; the queue is sent when the server answers again."""

    _offline_said = False  # one line per process, however many runs it opens

    def __init__(self, run_id: str, offline: bool = False):
        from components.tracking.outbox import Outbox

        self._id = run_id
        self._client = client()
        self._pending: list[Any] = []
        self._outbox = Outbox()
        self._offline, self._last_try = offline, time.monotonic()

    @property
    def offline(self) -> bool:
        """Logging to the on-disk queue (the tracking server did not answer)."""
        return self._offline

    @property
    def run_id(self) -> str:
        """The server's id (a run created during an outage has a local one until its queue is sent)."""
        self._id = self._outbox.resolve(self._id) or self._id
        return self._id

    # ---- every call goes through _do: straight to the server, or to the queue while it does not answer

    def _do(self, op: dict[str, Any], send) -> Any:
        if self._queueing():
            self._outbox.add(op)
            return None
        try:
            return send()
        except Exception as err:  # only an outage of a remote server is queued
            from components.tracking.outbox import is_outage, is_remote

            if not (is_remote(tracking_uri()) and is_outage(err)):
                raise
            self._go_offline(err)
            self._outbox.add(op)
            return None

    def _queueing(self) -> bool:
        """True while the server is away: retried every GRPO_TRACKING_RETRY_S (the queue first, in order)."""
        from components.tracking.outbox import answers, retry_every_s

        if not self._offline:
            return False
        if time.monotonic() - self._last_try < retry_every_s():
            return True
        self._last_try = time.monotonic()
        if answers(tracking_uri()) and send_queue(self._client, say=True):
            self._offline = False
        return self._offline

    def _go_offline(self, err: BaseException) -> None:
        from components.tracking.outbox import retry_every_s

        self._offline, self._last_try = True, time.monotonic()
        if not StageRun._offline_said and self._outbox.announce_outage(os.environ.get(PARENT_RUN_ENV)):
            print(f"tracking: the MLflow tracking server at {tracking_uri()} does not answer ({type(err).__name__}); "
                  f"logging to {self._outbox.root}/ and going on; sent when it answers again (tried every "
                  f"{retry_every_s():.0f} s, and at the next run's start)", flush=True)
        StageRun._offline_said = True

    # ---- the calls

    def log_params(self, params: dict[str, Any]) -> None:
        from mlflow.entities import Param

        items = [Param(k, str(v)[:6000]) for k, v in params.items() if not is_secret_key(k)]
        with deferred():
            for i in range(0, len(items), 100):
                chunk = items[i: i + 100]
                self._do({"op": "log_batch", "run": self.run_id, "params": [[p.key, p.value] for p in chunk]},
                         lambda chunk=chunk: self._client.log_batch(self.run_id, params=chunk))

    def log_metrics(self, metrics: dict[str, float], step: int | None = None, flush: bool = True) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self._pending += [Metric(k, float(v), now, step or 0) for k, v in metrics.items() if v == v]
        if flush:
            self.flush()

    def flush(self) -> None:
        with deferred():  # an SQLite write cut by a signal would keep its lock
            for i in range(0, len(self._pending), 1000):
                chunk = self._pending[i: i + 1000]
                self._do({"op": "log_batch", "run": self.run_id,
                          "metrics": [[m.key, m.value, m.timestamp, m.step] for m in chunk]},
                         lambda chunk=chunk: self._client.log_batch(self.run_id, metrics=chunk))
            self._pending = []

    def set_tags(self, tags: dict[str, Any]) -> None:
        from mlflow.entities import RunTag

        items = [RunTag(k, str(v)) for k, v in tags.items()]
        with deferred():
            for i in range(0, len(items), 100):
                chunk = items[i: i + 100]
                self._do({"op": "log_batch", "run": self.run_id, "tags": [[t.key, t.value] for t in chunk]},
                         lambda chunk=chunk: self._client.log_batch(self.run_id, tags=chunk))

    def log_artifact(self, path: str | Path, artifact_path: str | None = None) -> None:
        path = Path(path)
        if not path.exists():
            return
        send = self._client.log_artifacts if path.is_dir() else self._client.log_artifact
        self._do({"op": "artifact", "run": self.run_id, "file": str(path), "artifact_path": artifact_path},
                 lambda: send(self.run_id, str(path), artifact_path))

    def log_table(self, rows: list[dict[str, Any]], artifact_file: str) -> None:
        import pandas as pd

        self._do({"op": "table", "run": self.run_id, "rows": rows, "artifact_file": artifact_file},
                 lambda: self._client.log_table(self.run_id, data=pd.DataFrame(rows), artifact_file=artifact_file))

    def log_text(self, text: str, artifact_file: str) -> None:
        self._do({"op": "text", "run": self.run_id, "text": text, "artifact_file": artifact_file},
                 lambda: self._client.log_text(self.run_id, text, artifact_file))

    def log_checkpoint_model(self, name: str, step: int, metrics: dict[str, float], tags: dict[str, Any]) -> str:
        """One training checkpoint as an MLflow LoggedModel carrying its step and held-out metrics: the
        experiment's Models tab lists every evaluated checkpoint of every run side by side."""
        from components.tracking.outbox import create_checkpoint_model, local_id

        tags = {k: str(v) for k, v in tags.items()}
        queued = local_id()
        with deferred():
            made = self._do({"op": "checkpoint_model", "run": self.run_id, "id": queued, "name": name, "step": step,
                             "metrics": metrics, "tags": tags, "time": int(time.time() * 1000)},
                            lambda: create_checkpoint_model(self._client, self.run_id, name, step, metrics, tags))
        return made or queued

    def set_model_tags(self, model_id: str, tags: dict[str, Any]) -> None:
        model = self._outbox.resolve(model_id)
        tags = {k: str(v) for k, v in tags.items()}
        with deferred():
            self._do({"op": "model_tags", "model": model, "tags": tags},
                     lambda: self._client.set_logged_model_tags(model, tags))

    def terminate(self, status: str) -> None:
        self._do({"op": "terminate", "run": self.run_id, "status": status, "time": int(time.time() * 1000)},
                 lambda: self._client.set_terminated(self.run_id, status=status))


_unreachable: dict[str, float | None] = {"since": None}


def note_unreachable() -> None:
    """The stage's start-up found the server away (after its bounded retries): the run starts offline at once."""
    _unreachable["since"] = time.monotonic()


def send_queue(mlflow_client, say: bool = False) -> bool:
    """Send what an earlier outage queued; True when nothing is left (False: the server is still away)."""
    from components.tracking.outbox import Outbox, is_outage

    outbox = Outbox()
    waiting = outbox.pending()
    if not waiting:
        return True
    try:
        sent = outbox.send(mlflow_client)
    except Exception as err:  # an outage leaves the rest queued; anything else is a bug
        if is_outage(err):
            return False
        raise
    outbox.outage_ended()
    if say or sent:
        print(f"tracking: the tracking server answers again: sent {sent} queued records", flush=True)
    return True


def start_run(experiment: str, run_name: str, parent_run_id: str | None = None,
              tags: dict[str, str] | None = None) -> StageRun:
    """Create a run (a child of `parent_run_id` when given) and return its handle; while a remote tracking
    server does not answer, a run with a local id whose creation is queued (and said once)."""
    from components.tracking.outbox import Outbox, TrackingUnreachable, answers, is_outage, is_remote, local_id

    all_tags = dict(tags or {})
    if parent_run_id:
        all_tags["mlflow.parentRunId"] = Outbox().resolve(parent_run_id)
    all_tags["mlflow.runName"] = run_name
    c = client()
    try:
        if _unreachable["since"] is not None and not answers(tracking_uri()):  # known away: no second wait
            raise TrackingUnreachable(f"the tracking server at {tracking_uri()} did not answer the start-up check")
        if send_queue(c):  # what an earlier outage left goes first, in order
            run = c.create_run(experiment_id(experiment), run_name=run_name, tags=all_tags)
            return StageRun(run.info.run_id)
        err: BaseException = TrackingUnreachable("an earlier outage's queue could not be sent")
    except Exception as caught:  # only an outage of a remote server goes offline
        if not (is_remote(tracking_uri()) and is_outage(caught)):
            raise
        err = caught
    offline = StageRun(local_id(), offline=True)
    offline._go_offline(err)
    offline._outbox.add({"op": "create_run", "id": offline._id, "experiment": experiment, "tags": all_tags,
                         "time": int(time.time() * 1000)})
    return offline


@contextlib.contextmanager
def stage_run(experiment: str, stage: str, params: dict[str, Any] | None = None) -> Iterator[StageRun]:
    """A nested run for one stage; marked FAILED if the stage raises, FINISHED otherwise."""
    run = start_run(experiment, stage, os.environ.get(PARENT_RUN_ENV), tags={"grpo.stage": stage})
    if params:
        run.log_params(params)
    status = "FAILED"
    try:
        yield run
        status = "FINISHED"
    except KeyboardInterrupt:  # stopped by a signal (components/interruptions.py)
        status = "KILLED"
        raise
    finally:
        with deferred():
            run.flush()
            run.terminate(status)


class NullRun:
    """Stands in for an MLflow run on ranks other than 0: they train but never log."""

    run_id = None

    def log_params(self, *args: Any, **kwargs: Any) -> None: ...

    def log_metrics(self, *args: Any, **kwargs: Any) -> None: ...

    def flush(self) -> None: ...

    def set_tags(self, *args: Any, **kwargs: Any) -> None: ...

    def log_artifact(self, *args: Any, **kwargs: Any) -> None: ...

    def log_checkpoint_model(self, *args: Any, **kwargs: Any) -> None: ...

    def set_model_tags(self, *args: Any, **kwargs: Any) -> None: ...

    def log_table(self, *args: Any, **kwargs: Any) -> None: ...

    def log_text(self, *args: Any, **kwargs: Any) -> None: ...

    def terminate(self, *args: Any, **kwargs: Any) -> None: ...


def tracking_run(is_main: bool, experiment: str, stage: str, params: dict[str, Any]):
    """The stage's MLflow run on the main process (rank 0); a no-op run on the other ranks."""
    if is_main:
        return stage_run(experiment, stage, params)
    return contextlib.nullcontext(NullRun())
