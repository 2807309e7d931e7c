"""A stage's note that it is running, so that whoever sees it die silently can say what happened.

Every way a stage can end runs Python's `finally` (success, an error, SIGINT/SIGTERM), which removes the
note, except a death no Python code sees: SIGKILL (the kernel's out-of-memory killer, a preempted machine,
`kill -9`), `os._exit`, a segfault or an abort in a C extension. A note left by a process that no longer
exists is therefore one of those; it says how far the run got, how much memory its step was estimated to
need, and whether the user's code was running at that moment (`user_code`, written by components/user_code.py).

The stage's launcher reads it first (components/runtime/launch.py: it knows the exit code or the signal)
and reports in one line; when the launcher died too, the rerun reads it (`killed_run_text`).

One note per stage process: a second `RunMarker` on the same path in the same process (the grpo stage's own,
beside the stage CLI's) shares the first one's fields, so neither overwrites what the other wrote.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path
from typing import Any


def pid_alive(pid: int, written_at: float | None = None) -> bool:
    """Whether `pid` lives and, when `written_at` is given, started before then (a pid reused after a reboot, or by
    an unrelated process since, is not the note's writer)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    if written_at is None:
        return True
    try:
        import psutil

        return psutil.Process(pid).create_time() <= written_at + 1.0
    except Exception:  # noqa: BLE001 - gone since, or not ours to look at: judged by os.kill above
        return True


def marker_path(stage: str, root: Path = Path(".")) -> Path:
    """Where stage `stage` keeps its note: checkpoints/<stage>.running.json, beside the training checkpoints."""
    from components.data.paths import Paths

    return Paths(root).grpo_checkpoints.parent / f"{stage}.running.json"


_current: dict[str, RunMarker | None] = {"marker": None}
PAGE = 4096  # the note's size on disk, padded with spaces (valid JSON whitespace)


class RunMarker:
    """`path` holds {pid, started, step, steps, last_checkpoint, user_code, ...} while the stage runs."""

    def __init__(self, path: Path):
        self.path = path
        active = _current["marker"]
        same = active is not None and os.path.abspath(active.path) == os.path.abspath(path)
        self.fields: dict[str, Any] = active.fields if same else {}
        self._fd: int | None = None

    def left_by_a_killed_run(self) -> dict[str, Any] | None:
        """The note of an earlier run whose process is gone without removing it, else None."""
        return read_dead_note(self.path)

    def write(self, **fields: Any) -> None:
        """Update the note in place: one write of one padded page at offset 0 (a kill leaves the previous note or
        this one). Cheap enough for every reward call; a temp file renamed over the note would make ext4 flush
        the replaced contents each time."""
        self.fields.update(fields, pid=os.getpid())
        self.fields.setdefault("started", time.strftime("%Y-%m-%d %H:%M:%S"))
        _current["marker"] = self  # the process's note from its first write on (one only read never is)
        if self._fd is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        data = json.dumps(self.fields).encode()
        os.pwrite(self._fd, data.ljust(PAGE), 0)
        if len(data) > PAGE:
            os.ftruncate(self._fd, len(data))

    def clear(self) -> None:
        """Remove the note (and its folder when nothing else is in it: a stage before GRPO leaves no trace)."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        self.path.unlink(missing_ok=True)
        if self.path.parent.name == "checkpoints":  # the folder marker_path puts notes in; nothing else is touched
            try:
                self.path.parent.rmdir()
            except OSError:
                pass  # not empty (checkpoints, another stage's note) or already gone
        if _current["marker"] is self:
            _current["marker"] = None


def current() -> RunMarker:
    """This process's note (the stage's), or one that writes nothing when there is none."""
    return _current["marker"] or NoMarker()


def read_dead_note(path: Path) -> dict[str, Any] | None:
    """The note at `path` when the process that wrote it is gone, else None. A note a kill cut short or emptied (it
    names no pid) was left by a process that is gone too: it comes back as `{"cut_short": True}`."""
    try:
        text = path.read_text()
        written_at = path.stat().st_mtime
    except OSError:
        return None
    try:
        note = json.loads(text)
    except ValueError:
        note = None
    if not isinstance(note, dict):
        return {"cut_short": True}
    pid = note.get("pid")
    alive = isinstance(pid, int) and pid_alive(pid, written_at)  # this process's own note included
    return None if alive else note


def _where(note: dict[str, Any]) -> str:
    """` at step 5 of 6; the last checkpoint is step 3` (where the user's code was running, while it runs),
    ` at step 12 of 24` (the last step the note recorded), or nothing."""
    if note.get("progress"):
        return f" {note['progress']}"
    return f" at step {note['step']} of {note['steps']}" if "step" in note and "steps" in note else ""


OOM_LIKELY_SHARE = 0.75
"""A SIGKILL is put down to the out-of-memory killer only when the step's estimate took at least this share of the
memory that was free when the stage started; otherwise it is "another process or the machine"."""


def _memory(note: dict[str, Any]) -> str:
    memory = (f"; its step was estimated at {note['estimate_gb']:.1f} GB with {note['available_gb']:.1f} GB free"
              if "estimate_gb" in note and "available_gb" in note else "")
    return memory + (f" (lower it with {note['knobs']})" if note.get("knobs") and oom_likely(note) else "")


def oom_likely(note: dict[str, Any]) -> bool:
    """Whether the note's memory estimate makes the kernel's out-of-memory killer the likely sender of a SIGKILL."""
    estimate, free = note.get("estimate_gb"), note.get("available_gb")
    return isinstance(estimate, int | float) and isinstance(free, int | float) and estimate >= OOM_LIKELY_SHARE * free


def _killer(note: dict[str, Any]) -> str:
    return ("likely by the kernel's out-of-memory killer" if oom_likely(note)
            else "by another process or the machine (a preempted machine, `kill -9`)")


def killed_run_text(stage: str, note: dict[str, Any]) -> str:
    """One line for the rerun: what the note says about the run that died without a word."""
    if note.get("cut_short"):
        return (f"{stage}: the previous run of this stage was killed (SIGKILL) while it wrote its note, which it left "
                "cut short (replaced now)")
    who = f"{stage}: the previous run of this stage (pid {note.get('pid')}, started {note.get('started')})"
    if note.get("user_code"):
        return (f"{who} ended while {note['user_code']} was {note.get('user_code_doing', 'running')}"
                f"{_where(note)}: the user's code ended the process (os._exit, a crash or an abort in a C "
                "extension), not the pipeline")
    return (f"{who} ended without a word{_where(note) or ' during its run'}: it was killed (SIGKILL), "
            f"{_killer(note)}{_memory(note)}")


def ended_text(note: dict[str, Any], status: int) -> str:
    """One line for the stage's parent, which saw it end with `status` (an exit code, or minus a signal) and
    found its note: what was running when it died."""
    how = f"signal {signal.Signals(-status).name}" if status < 0 else f"exit code {status}"
    if note.get("user_code"):
        return (f"the stage ended while {note['user_code']} was {note.get('user_code_doing', 'running')} ({how})"
                f"{_where(note)}: the user's code ended the process; fix it and rerun")
    if status == -signal.SIGKILL:
        if oom_likely(note):
            return (f"the stage was killed by SIGKILL{_where(note)}, likely by the kernel's out-of-memory "
                    f"killer{_memory(note)}; rerun to resume")
        return f"the stage was killed by SIGKILL (another process or the machine){_where(note)}{_memory(note)}; " \
               "rerun to resume"
    return f"the stage ended without a word ({how}){_where(note)}; rerun to resume"


class NoMarker(RunMarker):
    """For processes that keep no note (ranks other than 0): every method does nothing, nothing is written."""

    def __init__(self) -> None:
        self.path = Path()
        self.fields = {}
        self._fd = None

    def left_by_a_killed_run(self) -> dict[str, Any] | None:
        return None

    def write(self, **fields: Any) -> None:
        self.fields.update(fields)

    def clear(self) -> None:
        pass
