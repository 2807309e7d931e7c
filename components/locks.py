"""Advisory file locks: one pipeline run per repository, one registry change at a time.

`flock` locks die with their process, so a SIGKILLed run never leaves a stale lock behind.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import time
from collections.abc import Iterator
from pathlib import Path

PIPELINE_LOCK = ".grpo-pipeline.lock"
REGISTRY_LOCK = ".grpo-registry.lock"
LOCK_HELD_ENV = "GRPO_PIPELINE_LOCK_HELD"  # set by the CLI, which already holds the pipeline lock


class LockBusy(RuntimeError):
    """Another process holds the lock; the message says which."""


@contextlib.contextmanager
def file_lock(path: Path, what: str, wait_s: float = 0.0) -> Iterator[None]:
    """Hold an exclusive lock on `path`; wait up to `wait_s` seconds, then raise `LockBusy`."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fh = open(path, "a+")
    deadline = time.monotonic() + wait_s
    while True:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
            break
        except BlockingIOError:
            if time.monotonic() >= deadline:
                fh.seek(0)
                holder = fh.read().strip() or "unknown"
                fh.close()
                raise LockBusy(f"{what} is already running ({holder}); wait for it to finish") from None
            time.sleep(0.2)
    try:
        fh.seek(0)
        fh.truncate()
        fh.write(f"pid {os.getpid()}, since {time.strftime('%Y-%m-%d %H:%M:%S')}")
        fh.flush()
        yield
    finally:
        fcntl.flock(fh, fcntl.LOCK_UN)
        fh.close()
