"""Which stage failures are retried: an outage of the pipeline's own connection to one of its servers, nothing else.

A stage runs as a subprocess; when its connection to the MLflow tracking server fails after the client's bounded
retries, its report says so in a field of its own (`outage`: which server, where), set where the error was raised
(components/stages/cli.py: an error out of MLflow's client, never out of the user's code). Only that field makes a
failure worth retrying: a reward, tool or environment that raises `ConnectionError` (or any text about connections)
fails the stage after one attempt, with its own report. When a retry happens, one line says which server did not
answer and when the stage runs again; Prefect's own retry line is left out (pipelines/flow.py `OneLineStageErrors`).
"""

from __future__ import annotations

import sys
import time
from typing import Any


def outage_of(error: Any) -> dict[str, str] | None:
    """{"server", "address"} of the server whose connection failed, from the failure's own field; else None."""
    outage = getattr(error, "outage", None)
    return outage if isinstance(outage, dict) and outage.get("server") else None


def is_transient(error: Any) -> bool:
    """True only for a failure that carries an outage of the pipeline's own server connection."""
    return outage_of(error) is not None


def retry_line(stage: str, outage: dict[str, str], retry: int, retries: int, delay_s: float,
               now: float | None = None) -> str:
    """The line a retry prints: `grpo: the MLflow tracking server at URL did not answer; the stage runs again in
    DELAY s (at HH:MM:SS; retry R of RETRIES)`."""
    when = time.strftime("%H:%M:%S", time.localtime((now if now is not None else time.time()) + delay_s))
    where = f" at {outage['address']}" if outage.get("address") else ""
    return (f"{stage}: the {outage['server']}{where} did not answer; the stage runs again in {delay_s:.0f} s (at "
            f"{when}; retry {retry} of {retries})")


def retry_transient(task: Any, task_run: Any, state: Any) -> bool:
    """Prefect `retry_condition_fn` (called only while retries are left): retry an outage, saying so in one line."""
    try:
        error = state.result(raise_on_failure=False)
    except Exception as err:  # noqa: BLE001 - the result itself could not be read: judge that error
        error = err
    outage = outage_of(error)
    if outage is None:
        return False
    retry = max(int(getattr(task_run, "run_count", 1) or 1), 1)
    delays = getattr(task, "retry_delay_seconds", None) or [0]
    delay = delays[min(retry - 1, len(delays) - 1)] if isinstance(delays, list) else float(delays)
    stage = str(getattr(task, "name", "stage")).removeprefix("stage-")
    # written, not printed: the flow logs its prints through Prefect (a log line of Prefect's, not this one)
    sys.stderr.write(retry_line(stage, outage, retry, int(getattr(task, "retries", 0) or 0), float(delay)) + "\n")
    sys.stderr.flush()
    return True


def backoff_delays(first_s: float, retries: int) -> list[float]:
    """`first`, `3 * first`, `9 * first`, ...: one delay per retry."""
    return [first_s * 3 ** i for i in range(retries)]
