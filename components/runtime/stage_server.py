"""A warm interpreter for stage processes: import torch, transformers and MLflow once, fork per stage.

Every DVC stage is its own process, and each used to pay Python start-up plus seconds of imports.
The pipeline flow starts one `stage_server` per run; `python -m components.runtime.launch STAGE` (the
dvc.yaml commands) then hands its argv, working directory, environment and stdio to the server,
which forks a child that runs the stage exactly as `python -m components.stages.<stage>` would, and
relays the exit code. DVC still runs, times and records each stage; only the import cost goes.

Without a server (plain `dvc repro`), or when the caller's import-time environment differs from
the server's, the launcher simply runs the stage itself.

The server is a tree of processes, one per import level (LEVELS), each forked from its parent level
once the parent's imports are done, in the order the stages need them: level 0 imports MLflow and serves
`prepare` and the flow's MLflow jobs; level 1 adds torch, transformers' config, tokenizers and the
Llama modelling code and serves `model`; from level 1 fork level 2, Great Expectations for `validate`, and
level 3, the training stages' modules and MLflow's pyfunc. So `prepare` and the MLflow jobs start while torch
is still being imported, and no request ever waits for an import it does not need. (The modelling code
imports before either child: beside Great Expectations it competed for the two cores while `model` waited.)
Callers connect to their stage's level socket (`level_path`).

Level 2 is lazy (LAZY_LEVELS): it imports Great Expectations, seconds of CPU, only once someone connects
to it: `validate`'s request, or the hint a `prepare` request sends first (`WARMS`: new data is what
`validate` checks). A rerun whose data did not change (a changed GRPO setting, a resumed or repeated run)
never imports it, and its training level no longer waits behind it.

Garbage collection: a level imports with the collector off and freezes what it imported before it
forks (`imports_without_collection`, which the CLI and the temporary Prefect API use too). The
imports allocate hundreds of thousands of objects that live as long as the process; collecting while
they pile up costs import time, and a child that later ran a full collection walked them all.
Frozen, they are outside the collector's view; each stage child collects its own objects as usual.

Fork safety: a level only imports; it never runs a torch op or opens a database connection, so
no thread pool or connection exists to be inherited half-initialised; and no process forks while
it is importing (a child must not inherit a half-imported module).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib
import json
import os
import select
import signal
import socket
import sys
import time
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

from components.quiet import quiet_libraries

if TYPE_CHECKING:
    import subprocess

SERVER_ENV = "GRPO_STAGE_SERVER"
# Environment read when libraries are imported; a caller whose values differ gets its own process.
# PYTHONPATH too: a process's module search path is fixed when it starts, so a stage forked from a server started
# with another one would not find the caller's modules.
IMPORT_TIME_PREFIXES = ("HF_", "TRANSFORMERS_", "TORCH", "PYTORCH", "OMP_", "MKL_", "CUDA", "TOKENIZERS_",
                        "PYTHONHASHSEED", "PYTHONPATH", "LD_PRELOAD", "GX_")
STAGE_MODULES = {stage: f"stages.{stage}" for stage in
                 ("prepare", "model", "validate", "sft", "grpo", "evaluate", "register")}
# Jobs the flow runs in the server besides the DVC stages (the CLI then never imports MLflow).
JOB_MODULES = {"parent_run": "runtime.parent_run"}
SERVED_MODULES = {**STAGE_MODULES, **JOB_MODULES}
# (parent level, what the level imports on top of its parent's modules; "module:function" also calls the function,
# which may only read files); see the module docstring.
LEVELS: tuple[tuple[int | None, tuple[str, ...]], ...] = (
    (None, ("numpy", "pandas", "mlflow",
            # MLflow imports its SQL stores (and configures their ORM mappers) on first use:
            # about a second in every stage that opens the tracking store.
            "mlflow.store.tracking.sqlalchemy_store", "mlflow.store.model_registry.sqlalchemy_store",
            # ... and, opening a store, its SQLite dialect, Alembic's schema check and the tracing
            # provider: 45 ms more in every stage and job (100 -> 55 ms) when left to the child.
            "sqlalchemy.dialects.sqlite", "alembic.command", "mlflow.tracing.processor.otel",
            "mlflow.store.tracking.sqlalchemy_workspace_store",
            # MLflow's schema head, read from its migration scripts a few times per stage otherwise
            "components.tracking.local_store:remember_schema_head",
            "components.runtime.parent_run", "components.stages.prepare")),
    (0, ("torch", "transformers", "transformers.models.auto.tokenization_auto",
         "transformers.models.auto.configuration_auto", "transformers.models.llama.modeling_llama",
         "components.stages.model")),
    (1, ("great_expectations", "components.stages.validate")),
    # Needed from `sft` on: imported once `model` can run, beside (not behind) Great Expectations.
    (1, ("components.stages.sft", "components.stages.grpo",
         "components.stages.evaluate", "mlflow.pyfunc", "components.stages.register",
         # the figures `grpo` draws at its end (components/tracking/reports.py): pyplot's import, not the drawing
         "matplotlib.pyplot")),
)
# Levels that import only once a caller connects (see the module docstring), and the stages whose request first
# wakes another stage's level: `prepare` writes the data that `validate` checks.
LAZY_LEVELS = frozenset({2})
WARMS = {"prepare": ("validate",)}
HEADER_LIMIT = 1 << 20
# Objects this process's levels froze (their imports), counted as each level froze them. A stage
# forked from a level inherits the figure for its timings record (components/stages/cli.py);
# `gc.get_freeze_count()` would walk all ~800,000 of them, 60-140 ms at every stage's end.
frozen_objects = 0


@contextmanager
def imports_without_collection() -> Iterator[None]:
    """Import with the garbage collector off, then freeze what was imported.

    Importing Prefect, DVC, MLflow or torch allocates hundreds of thousands of objects that live as
    long as the process; collecting while they pile up costs import time.
    Frozen afterwards, they stay outside later collections, which then only walk new objects.
    """
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        gc.freeze()
        if was_enabled:
            gc.enable()


def import_environment(env: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if k.startswith(IMPORT_TIME_PREFIXES)}


# ---------------------------------------------------------------------------------------------- server
def level_of(stage: str) -> int:
    """The level whose process has imported `stage`'s module (the last level for anything else)."""
    module = f"components.{SERVED_MODULES.get(stage, '')}"
    return next((i for i, (_, names) in enumerate(LEVELS) if module in names), len(LEVELS) - 1)


def level_modules(level: int) -> set[str]:
    """Everything a level's process has imported: its own modules and its ancestors'."""
    names: set[str] = set()
    while level is not None:
        parent, own = LEVELS[level]
        names.update(name.partition(":")[0] for name in own)
        level = parent
    return names


def level_path(path: str, level: int) -> str:
    return path if level == 0 else f"{path}.{level}"


def die_with_parent(sig: int = signal.SIGTERM) -> None:
    """`sig` when the parent process exits (Linux): a level still importing stops with the server, and
    the temporary Prefect API (forked from the CLI, pipelines/warmup.py; SIGINT, the one signal it stops on) with
    the CLI."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, sig)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass  # elsewhere: the level notices its parent is gone when it next looks (every 0.2 s)


def serve(path: str, parent_pid: int) -> None:
    """Bind every level's socket first (callers queue), then become the tree of levels and serve."""
    global frozen_objects
    listeners = []
    for level in range(len(LEVELS)):
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(level_path(path, level))
        listener.listen(8)
        listeners.append(listener)
    own_environment = import_environment(dict(os.environ))  # what the imports below see (some add variables)
    level, watched = 0, parent_pid

    def stop(*_) -> None:  # nothing to flush: a level holds only imports; skipping teardown saves seconds
        with contextlib.suppress(FileNotFoundError):  # stop_server may remove it first
            os.unlink(level_path(path, level))
        os._exit(0)

    signal.signal(signal.SIGTERM, stop)
    while True:
        if level in LAZY_LEVELS:
            wait_for_a_caller(listeners[level], watched)
        with imports_without_collection():  # see "Garbage collection" above
            for name in LEVELS[level][1]:
                module, _, function = name.partition(":")
                try:
                    imported = importlib.import_module(module)
                    if function:
                        getattr(imported, function)()
                except Exception:  # noqa: BLE001 - an optional library missing: its stage imports (and reports) it
                    pass
            frozen_objects += len(gc.get_objects())  # what the freeze below moves: this level's own objects
        sys.stdout.flush()
        sys.stderr.flush()
        child_level, forker = None, os.getpid()
        for candidate in (i for i, (parent, _) in enumerate(LEVELS) if parent == level):
            if os.fork() == 0:  # forked between imports, before this level serves anything
                child_level = candidate
                break
        if child_level is None:
            break  # this process serves `level`
        die_with_parent()
        if os.getppid() != forker:  # the parent level stopped before the death signal was armed
            os._exit(0)
        level, watched = child_level, forker
    for other, listener in enumerate(listeners):
        if other != level:
            listener.close()
    listener = listeners[level]
    listener.settimeout(0.2)
    while os.getppid() == watched:
        try:
            conn, _ = listener.accept()
        except TimeoutError:
            continue
        with conn:
            _handle(conn, listener, own_environment)
    stop()


def wait_for_a_caller(listener: socket.socket, watched: int) -> None:
    """Return once a caller has connected to `listener` (left queued for the serving loop); stop with the level
    `watched` (the parent) if that never happens."""
    while not select.select([listener], [], [], 0.2)[0]:
        if os.getppid() != watched:
            os._exit(0)


def _handle(conn: socket.socket, listener: socket.socket, own_environment: dict[str, str]) -> None:
    data, fds, _, _ = socket.recv_fds(conn, HEADER_LIMIT, 3)
    if not data:  # a hint to import (`warm`), not a request
        for fd in fds:
            os.close(fd)
        return
    try:
        request = json.loads(data.decode())
        theirs = import_environment(request["env"])
        differing = sorted(k for k in set(theirs) | set(own_environment) if theirs.get(k) != own_environment.get(k))
        if request.get("probe") or len(fds) != 3 or differing:  # a probe (stage_client.server_accepts): answered only
            _send(conn, {"accepted": bool(request.get("probe")) and not differing, "differing": differing})
            return
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            listener.close()
            conn.close()
            _run_child(request, fds)  # never returns
        caller_gone = not _send(conn, {"accepted": True, "pid": pid})
        conn.setblocking(False)
        exited = _exit_notifier(pid)
        stop_asked: list[int] = []

        def relay(signum: int, _frame: object) -> None:
            # Told to stop while serving (a SIGTERM to every process of the run: systemd, `pkill -f`): the stage stops
            # as it does on its caller's signal and its exit is reported; the server stops after that.
            stop_asked.append(signum)
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signum)

        stop = signal.signal(signal.SIGTERM, relay)
        try:
            while True:
                done, status = os.waitpid(pid, os.WNOHANG)
                if done:
                    if not caller_gone:
                        conn.setblocking(True)
                        _send(conn, {"exit": os.waitstatus_to_exitcode(status)})
                    return
                watched = ([] if caller_gone else [conn]) + ([exited] if exited is not None else [])
                readable, _, _ = select.select(watched, [], [], 0.05 if exited is None else 1.0)
                if conn not in readable:
                    continue
                try:
                    message = conn.recv(64)
                except OSError:
                    message = b""
                if not message or message.startswith(b"kill"):  # the caller went away or was interrupted
                    # The caller's own signal (SIGINT for a Ctrl-C), so the stage reports what stopped it.
                    wanted = message[4:].strip()
                    os.kill(pid, int(wanted) if wanted.isdigit() else signal.SIGTERM)
                    caller_gone = caller_gone or not message
        finally:
            signal.signal(signal.SIGTERM, stop)
            if exited is not None:
                os.close(exited)
            if stop_asked and callable(stop):
                stop(stop_asked[0], None)
    finally:
        for fd in fds:
            os.close(fd)


def _exit_notifier(pid: int) -> int | None:
    """A descriptor that becomes readable when `pid` exits (Linux pidfd), so the exit code is relayed
    at once instead of at the next poll (seven stages and four MLflow jobs per run); None where
    the platform has none, and the loop polls."""
    try:
        return os.pidfd_open(pid)
    except (AttributeError, OSError):
        return None


def _send(conn: socket.socket, message: dict) -> bool:
    """Send one JSON line; False when the caller has gone (a caller's exit must never stop the server)."""
    try:
        conn.sendall(json.dumps(message).encode() + b"\n")
        return True
    except OSError:
        return False


def _run_child(request: dict, fds: list[int]) -> None:
    code = 1
    try:
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
            os.close(fd)
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, signal.SIG_DFL)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        sys.argv = [f"components.{SERVED_MODULES[request['stage']]}", *request["argv"]]
        module = importlib.import_module(f"components.{SERVED_MODULES[request['stage']]}")
        code = int(module.main(request["argv"]) or 0)
    except SystemExit as exit_:
        code = exit_.code if isinstance(exit_.code, int) else (0 if exit_.code is None else 1)
    except BaseException:  # noqa: BLE001 - the child reports like an uncaught exception would
        traceback.print_exc()
        code = 1
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


# ---------------------------------------------------------------------------------------------- owner
def start_server(cwd: str, module: str = "components.runtime.stage_server") -> tuple[subprocess.Popen[bytes], str]:
    """Start a server owned by this process; returns it and the socket path to put in `SERVER_ENV`.

    `module`: where the server lives in `cwd`'s tree (`reproduce` starts an older commit's own server).
    """
    import subprocess
    import tempfile

    remove_sockets_of_dead_owners(tempfile.gettempdir())
    path = os.path.join(tempfile.gettempdir(), f"{SOCKET_PREFIX}{os.getpid()}-{time.monotonic_ns()}.sock")
    if os.path.exists(path):
        os.unlink(path)
    # Its own session: a Ctrl-C in the terminal reaches the CLI and the stage's launcher, which stop
    # the stage in order; it must not kill the stage (or the server's import levels) mid-write.
    proc = subprocess.Popen([sys.executable, "-m", module, "--socket", path,
                             "--parent-pid", str(os.getpid())], stdin=subprocess.DEVNULL, cwd=cwd,
                            start_new_session=True)
    deadline = time.monotonic() + 10.0
    while not os.path.exists(path) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)  # bound before imports, so this waits milliseconds
    return proc, path


SOCKET_PREFIX = "grpo-stages-"  # + the owner's pid, "-", a start time: each level's socket in the temporary directory


def remove_sockets_of_dead_owners(folder: str) -> None:
    """Remove the level sockets of servers whose owner (the pid in their name) is gone: a run killed with SIGKILL
    leaves its server's sockets behind (its levels exit with it, nothing removes their files). A pid taken since by
    a process started after the socket is not its owner; a file this user may not remove is left as it is."""
    import glob

    from components.run_marker import pid_alive

    for socket_path in glob.glob(os.path.join(glob.escape(folder), f"{SOCKET_PREFIX}*-*.sock*")):
        owner = os.path.basename(socket_path)[len(SOCKET_PREFIX):].split("-", 1)[0]
        with contextlib.suppress(OSError):  # removed meanwhile, or not ours to remove
            if owner.isdigit() and not pid_alive(int(owner), os.stat(socket_path).st_mtime):
                os.unlink(socket_path)


def stop_server(proc: subprocess.Popen[bytes], path: str) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=5)
        except Exception:  # noqa: BLE001 - a server stuck (e.g. still importing) is killed
            proc.kill()
            proc.wait(timeout=10)
    for level in range(len(LEVELS)):  # the other levels exit with it (they watch their parent)
        with contextlib.suppress(FileNotFoundError):  # or a level, stopping, removed its own first
            os.unlink(level_path(path, level))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Warm stage interpreter (started by the pipeline flow).")
    parser.add_argument("--socket", required=True)
    parser.add_argument("--parent-pid", type=int, default=os.getppid())
    args = parser.parse_args(argv)
    quiet_libraries()  # as every stage sets them (components/stages/cli.py), before its imports read them
    serve(args.socket, args.parent_pid)  # never returns: each level removes its own socket and exits
    return 0


if __name__ == "__main__":
    # Serve from the importable module, not `__main__`: the stages forked from it read `frozen_objects`
    # as components.runtime.stage_server (and must not find a second, empty copy of this module).
    from components.runtime import stage_server

    sys.exit(stage_server.main())
