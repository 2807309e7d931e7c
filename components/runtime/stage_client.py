"""The caller's side of the warm stage server (components/runtime/stage_server.py): hand a stage to it
(`run_remote`), wake a lazy level early (`warm`), and ask whether a server named in the environment would run this
process's stages (`server_accepts`). Kept free of heavy imports: the launcher hands over in milliseconds."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import sys
import threading
import time

from components.quiet import QUIET_DEFAULTS
from components.runtime.stage_server import WARMS, level_of, level_path


def caller_environment() -> dict[str, str]:
    """This process's environment as its stages get it: with the quiet defaults, which the server imported under
    and every stage sets first thing, where the caller has none."""
    return {**QUIET_DEFAULTS, **os.environ}


def server_accepts(path: str | None, wait_s: float = 30.0) -> bool:
    """Whether the server at `path` answers and would run this process's stages (the same import-time environment):
    a run uses a server named in the environment only then, and starts its own otherwise."""
    if not path:
        return False
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
            conn.settimeout(wait_s)
            conn.connect(level_path(path, 0))
            conn.sendall(json.dumps({"probe": True, "env": caller_environment()}).encode())
            return bool(json.loads(conn.makefile("rb").readline() or b"{}").get("accepted"))
    except (OSError, ValueError):
        return False


def warm(path: str, stage: str) -> None:
    """Wake `stage`'s level if it is lazy: a connection that sends nothing, so its imports start now (best effort)."""
    with contextlib.suppress(OSError), socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
        conn.connect(level_path(path, level_of(stage)))


def run_remote(path: str, stage: str, argv: list[str], wait_s: float = 120.0) -> int | None:
    """Run `stage` in the server at `path`; None when it is unavailable or refuses (run it yourself then)."""
    for later in WARMS.get(stage, ()):
        warm(path, later)
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    deadline = time.monotonic() + 2.0
    while True:
        try:
            conn.connect(level_path(path, level_of(stage)))
            break
        except (FileNotFoundError, ConnectionRefusedError):
            if time.monotonic() > deadline:
                conn.close()
                return None
            time.sleep(0.05)
    request = {"stage": stage, "argv": argv, "cwd": os.getcwd(), "env": caller_environment()}
    sys.stdout.flush()
    sys.stderr.flush()
    socket.send_fds(conn, [json.dumps(request).encode()], [0, 1, 2])
    conn.settimeout(wait_s)  # the server answers once its imports are done
    reader = conn.makefile("rb")
    try:
        reply = json.loads(reader.readline() or b"{}")
    except (TimeoutError, ValueError):
        conn.close()
        return None
    if not reply.get("accepted"):
        print(f"stage server: not used ({', '.join(reply.get('differing', [])) or 'refused'} differ); "
              "running the stage in this process", file=sys.stderr)
        conn.close()
        return None

    def interrupt(signum, _frame):
        # The stage stops itself cleanly (components/stages/cli.py) and reports where; wait for its exit code.
        try:
            conn.sendall(f"kill {signum}".encode())
        except OSError:
            pass

    previous = {}
    if threading.current_thread() is threading.main_thread():  # signal handlers belong to the main thread
        previous = {sig: signal.signal(sig, interrupt) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        conn.settimeout(None)
        outcome = json.loads(reader.readline() or b'{"exit": 1}')
    finally:
        conn.close()
        for sig, handler in previous.items():  # the flow calls this more than once per process
            signal.signal(sig, handler)
    return int(outcome.get("exit", 1))
