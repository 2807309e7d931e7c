"""Stopping a stage on SIGINT/SIGTERM without breaking what it was writing.

The first signal raises `StageInterrupted` where the stage is, so `finally` blocks run and atomic
writes (checkpoints, models/: temp name, then rename) leave nothing half-done. Inside a `deferred()`
section (a tracking-store write: an SQLite transaction cut in two keeps its lock, and the next write
then waits out the busy timeout) the signal is held and raised when the section ends. Later signals
are ignored: one clean stop.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Callable, Iterator

_state: dict = {"depth": 0, "pending": None, "progress": "", "signum": None}


class StageInterrupted(KeyboardInterrupt):
    """SIGINT or SIGTERM reached the stage (a KeyboardInterrupt, so code that cleans up after Ctrl-C does)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def set_progress(text: str | Callable[[], str]) -> None:
    """Where the stage is (`at step 12 of 40; the last checkpoint is step 10`), for the interruption's report; a
    callable is read when the report is written, so what it names on disk is what is there at the stop."""
    _state["progress"] = text


def progress() -> str:
    text = _state["progress"]
    return text() if callable(text) else text


def stop_requested() -> int | None:
    """The stop signal this stage received, if any (code that catches everything must let it through)."""
    return _state["signum"]


def _interrupted(signum: int, _frame) -> None:
    _state["signum"] = signum
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    if _state["depth"]:
        _state["pending"] = signum
        return
    raise StageInterrupted(signum)


def stop_on_signals() -> None:
    """Install the handler for SIGINT and SIGTERM (main thread only)."""
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, _interrupted)


@contextlib.contextmanager
def deferred() -> Iterator[None]:
    """Hold a stop signal until the section ends (short writes that must not be cut in two)."""
    _state["depth"] += 1
    try:
        yield
    finally:
        _state["depth"] -= 1
        if _state["depth"] == 0 and _state["pending"] is not None:
            signum, _state["pending"] = _state["pending"], None
            raise StageInterrupted(signum)
