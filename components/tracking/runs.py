"""MLflow runs addressed by explicit run ids (the fluent active run is thread-local).

A pipeline run owns one parent run; each stage opens a nested child of the run id found in
`GRPO_PARENT_RUN_ID`, or a standalone run when a stage is launched on its own (plain `dvc repro`).
"""

from __future__ import annotations

import contextlib
import os
import re
import time
from pathlib import Path
from typing import Any, Iterator

from components.interruptions import deferred

PARENT_RUN_ENV = "GRPO_PARENT_RUN_ID"
# Whole name parts (split on . _ - and case changes), so MLFLOW_TRACKING_TOKEN, api_token and
# AWS_SECRET_ACCESS_KEY match while max_new_tokens (a token count, not a token) does not.
_SECRET_WORDS = {"token", "secret", "password", "passwd", "credential", "credentials", "apikey"}
_SECRET_PAIRS = {("api", "key"), ("access", "key"), ("private", "key"), ("secret", "key")}


def tracking_uri(root: Path = Path(".")) -> str:
    """`MLFLOW_TRACKING_URI` when set, else the SQLite store `mlflow.db` at the repository root."""
    return os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{(root / 'mlflow.db').resolve()}"


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
    for key, value in RETRY_DEFAULTS.items():
        os.environ.setdefault(key, value)
    import mlflow
    from mlflow.tracking import MlflowClient

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
    """A thin handle over one MLflow run: metrics batched, params stringified, secrets dropped."""

    def __init__(self, run_id: str):
        self.run_id = run_id
        self._client = client()
        self._pending: list[Any] = []

    def log_params(self, params: dict[str, Any]) -> None:
        from mlflow.entities import Param

        items = [Param(k, str(v)[:6000]) for k, v in params.items() if not is_secret_key(k)]
        with deferred():
            for i in range(0, len(items), 100):
                self._client.log_batch(self.run_id, params=items[i: i + 100])

    def log_metrics(self, metrics: dict[str, float], step: int | None = None, flush: bool = True) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self._pending += [Metric(k, float(v), now, step or 0) for k, v in metrics.items() if v == v]
        if flush:
            self.flush()

    def flush(self) -> None:
        with deferred():  # an SQLite write cut by a signal would keep its lock
            for i in range(0, len(self._pending), 1000):
                self._client.log_batch(self.run_id, metrics=self._pending[i: i + 1000])
            self._pending = []

    def set_tags(self, tags: dict[str, Any]) -> None:
        with deferred():
            for k, v in tags.items():
                self._client.set_tag(self.run_id, k, str(v))

    def log_artifact(self, path: str | Path, artifact_path: str | None = None) -> None:
        path = Path(path)
        if path.is_dir():
            self._client.log_artifacts(self.run_id, str(path), artifact_path)
        elif path.exists():
            self._client.log_artifact(self.run_id, str(path), artifact_path)

    def log_checkpoint_model(self, name: str, step: int, metrics: dict[str, float], tags: dict[str, Any]) -> str:
        """One training checkpoint as an MLflow LoggedModel carrying its step and held-out metrics: the
        experiment's Models tab lists every evaluated checkpoint of every run side by side."""
        from mlflow.entities import Metric

        with deferred():
            experiment = self._client.get_run(self.run_id).info.experiment_id
            model = self._client.create_logged_model(experiment, name=name, source_run_id=self.run_id,
                                                     tags={k: str(v) for k, v in tags.items()},
                                                     params={"step": str(step)})
            now = int(time.time() * 1000)
            self._client.log_batch(self.run_id, metrics=[
                Metric(k, float(v), now, step, model_id=model.model_id, run_id=self.run_id)
                for k, v in metrics.items() if v == v])
            self._client.finalize_logged_model(model.model_id, "READY")
        return model.model_id

    def set_model_tags(self, model_id: str, tags: dict[str, Any]) -> None:
        with deferred():
            self._client.set_logged_model_tags(model_id, {k: str(v) for k, v in tags.items()})


def start_run(experiment: str, run_name: str, parent_run_id: str | None = None,
              tags: dict[str, str] | None = None) -> StageRun:
    """Create a run (a child of `parent_run_id` when given) and return its handle."""
    all_tags = dict(tags or {})
    if parent_run_id:
        all_tags["mlflow.parentRunId"] = parent_run_id
    all_tags["mlflow.runName"] = run_name
    run = client().create_run(experiment_id(experiment), run_name=run_name, tags=all_tags)
    return StageRun(run.info.run_id)


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
            client().set_terminated(run.run_id, status=status)


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


def tracking_run(is_main: bool, experiment: str, stage: str, params: dict[str, Any]):
    """The stage's MLflow run on the main process (rank 0); a no-op run on the other ranks."""
    if is_main:
        return stage_run(experiment, stage, params)
    return contextlib.nullcontext(NullRun())
