"""Ctrl-C and SIGTERM during `grpo-pipeline run`: stop the running stage cleanly, end the Prefect flow
run Cancelled, exit 130 (SIGINT) or 143 (SIGTERM), and say where to resume.

A terminal's Ctrl-C reaches the CLI's process group: the CLI and the stage's launcher
(`python -m components.runtime.launch`), which asks the stage to stop. The stage server and the temporary
Prefect API run in sessions of their own, so they keep serving until the stage has reported. A
SIGTERM (a scheduler, `kill`) reaches the CLI alone: it forwards it to the stage's launcher; one sent to every
process of the run (systemd, `pkill -f`) stops the stage the same way, and the temporary API ignores it. The
stage raises where it was, writes nothing half-done (checkpoints and outputs are renamed into place),
and reports `interrupted during grpo at step N; the last checkpoint is step M` (components/stages/cli.py).
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Iterator

import psutil

_requested: dict[str, int | None] = {"signum": None}
_installed = {"cli": False}


def requested() -> int | None:
    """The first stop signal this process received, if any."""
    return _requested["signum"]


def exit_code() -> int:
    """128 + the signal: 130 for Ctrl-C, 143 for SIGTERM (SIGINT when the stage reported it alone)."""
    return 128 + (_requested["signum"] or signal.SIGINT)


def stage_launchers(pid: int | None = None) -> list[int]:
    """The running stage's launcher processes (`components.runtime.launch`, or a stage module run directly)
    among the processes below `pid` (psutil: Linux, macOS, Windows)."""
    launchers = []
    try:
        children = psutil.Process(pid or os.getpid()).children(recursive=True)
    except psutil.Error:
        return []
    for child in children:
        try:
            cmdline = child.cmdline()
        except psutil.Error:  # gone since it was listed, or not ours to read
            continue
        if any(part.startswith("components.") and part != "components.runtime.stage_server" for part in cmdline):
            launchers.append(child.pid)
    return launchers


def _on_signal(signum: int, _frame) -> None:
    if _requested["signum"] is None:
        _requested["signum"] = signum
        print(f"{signal.Signals(signum).name}: stopping the running stage (it saves nothing half-done) ...",
              flush=True)
    for pid in stage_launchers():
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass


def install() -> None:
    """Handle SIGINT and SIGTERM in the CLI for the rest of the run (main thread only)."""
    _installed["cli"] = True
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, _on_signal)


def uninstall() -> None:
    """Back to Python's defaults once the run is over (a Ctrl-C then stops the CLI at once)."""
    _installed["cli"] = False
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)


@contextlib.contextmanager
def inside_flow() -> Iterator[None]:
    """Prefect's flow engine installs a SIGTERM handler of its own (it raises TerminationSignal, which
    kills the stage mid-write); a CLI run puts its own back for the flow's stages, then restores Prefect's."""
    if not _installed["cli"] or threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {sig: signal.signal(sig, _on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
