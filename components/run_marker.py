"""A stage's note that it is running, so that the rerun after a silent death can say what happened.

Every way a stage can end runs Python's `finally` (success, an error, SIGINT/SIGTERM), which removes the
note, except SIGKILL: the kernel's out-of-memory killer, a preempted machine, `kill -9`. A note left by a
process that no longer exists is therefore that case, and it still says how far the run got and how much
memory its step was estimated to need.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class RunMarker:
    """`path` holds {pid, started, step, steps, last_checkpoint, ...} while the stage runs."""

    def __init__(self, path: Path):
        self.path = path
        self.fields: dict[str, Any] = {}

    def left_by_a_killed_run(self) -> dict[str, Any] | None:
        """The note of an earlier run whose process is gone without removing it, else None."""
        try:
            note = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return None
        pid = note.get("pid")
        return None if isinstance(pid, int) and (pid == os.getpid() or _alive(pid)) else note

    def write(self, **fields: Any) -> None:
        """Update the note (temp file, then rename: a kill mid-write leaves the previous note)."""
        self.fields.update(fields, pid=os.getpid())
        self.fields.setdefault("started", time.strftime("%Y-%m-%d %H:%M:%S"))
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text(json.dumps(self.fields))
        os.replace(tmp, self.path)

    def clear(self) -> None:
        self.path.unlink(missing_ok=True)


def killed_run_text(stage: str, note: dict[str, Any]) -> str:
    """One line for the rerun: what the note says about the run that died without a word."""
    where = f"at step {note['step']} of {note['steps']}" if "step" in note and "steps" in note else "during its run"
    memory = (f"; its step was estimated at {note['estimate_gb']:.1f} GB with {note['available_gb']:.1f} GB free"
              if "estimate_gb" in note and "available_gb" in note else "")
    knobs = f" (lower it with {note['knobs']})" if note.get("knobs") else ""
    return (f"{stage}: the previous run of this stage (pid {note.get('pid')}, started {note.get('started')}) ended "
            f"without a word {where}: it was killed (SIGKILL), most often by the kernel's out-of-memory killer"
            f"{memory}{knobs}, or a preempted machine")


class NoMarker(RunMarker):
    """For processes that keep no note (ranks other than 0): every method does nothing, nothing is written."""

    def __init__(self) -> None:
        super().__init__(Path())

    def left_by_a_killed_run(self) -> dict[str, Any] | None:
        return None

    def write(self, **fields: Any) -> None:
        self.fields.update(fields)

    def clear(self) -> None:
        pass
