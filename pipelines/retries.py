"""Which stage failures are worth retrying: a server that did not answer, never a deterministic refusal.

A stage runs as a subprocess, so its failure arrives as text (`StageError`) or, for failures in the
flow process itself, as an exception. Deterministic failures (validation, bad params, bad data)
are recognised first and never retried, whatever else their output says.
"""

from __future__ import annotations

import errno
from typing import Any

# Output of a stage whose tracking server or Prefect API could not be reached or was overloaded.
TRANSIENT_MARKERS = (
    "Connection refused", "Failed to establish a new connection", "Max retries exceeded", "ConnectionError",
    "ConnectTimeout", "ReadTimeout", "Read timed out", "Temporary failure in name resolution",
    "RemoteDisconnected", "Connection reset by peer", "502 Bad Gateway", "503 Service Unavailable",
    "504 Gateway Timeout", "too many 5", "did not answer",
)
# Failures that would fail again identically: retrying only delays the report.
DETERMINISTIC_MARKERS = (
    "validation failed", "rule '", "ConfigError", "DataError", "ModelLoadError", "nothing was trained",
    "params file", "unknown key",
)


def is_transient(error: BaseException | str | None) -> bool:
    """True for an unreachable/overloaded MLflow server or Prefect API; False for everything else."""
    if error is None:
        return False
    if isinstance(error, BaseException) and not isinstance(error, RuntimeError):
        if isinstance(error, (ConnectionError, TimeoutError)):
            return True
        if isinstance(error, OSError) and error.errno in (errno.ECONNREFUSED, errno.ECONNRESET, errno.EHOSTUNREACH):
            return True
        name = type(error).__name__
        if name in ("ConnectError", "ConnectTimeout", "ReadTimeout", "RemoteProtocolError", "PoolTimeout"):
            return True  # httpx (Prefect's client) and requests (MLflow's)
    text = f"{error}\n{getattr(error, 'detail', '')}"  # a StageError's report and the stage's last lines
    if any(marker in text for marker in DETERMINISTIC_MARKERS):
        return False
    return any(marker in text for marker in TRANSIENT_MARKERS)


def retry_transient(task: Any, task_run: Any, state: Any) -> bool:
    """Prefect `retry_condition_fn`: continue to the retry policy only for transient failures."""
    try:
        error = state.result(raise_on_failure=False)
    except Exception as err:  # noqa: BLE001 - the result itself could not be read: judge that error
        error = err
    if not isinstance(error, BaseException):
        error = getattr(state, "message", None) or ""
    return is_transient(error)


def backoff_delays(first_s: float, retries: int) -> list[float]:
    """`first`, `3 * first`, `9 * first`, ...: one delay per retry."""
    return [first_s * 3 ** i for i in range(retries)]
