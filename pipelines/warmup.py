"""Start the slow services of a pipeline run side by side instead of one after another.

A run needs two things that each take seconds to start: the warm stage interpreter (torch,
transformers, MLflow imports; it also opens the MLflow store, see components/runtime/parent_run.py) and
Prefect's temporary API server (when no PREFECT_API_URL is set). The CLI starts the stage server
first thing, and the API as soon as it has imported Prefect itself (forked from the CLI, sharing
that import); both come up while the CLI imports the flow and DVC, and the flow finds them ready.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import subprocess
import sys
import threading
from pathlib import Path


def configured_prefect_api() -> str | None:
    """PREFECT_API_URL from the environment or the active Prefect profile, read without importing Prefect."""
    if os.environ.get("PREFECT_API_URL"):
        return os.environ["PREFECT_API_URL"]
    home = Path(os.environ.get("PREFECT_HOME", Path.home() / ".prefect")).expanduser()
    profiles = home / "profiles.toml"
    if not profiles.exists():
        return None
    import tomllib

    try:
        data = tomllib.loads(profiles.read_text())
    except (OSError, tomllib.TOMLDecodeError):
        return None
    active = os.environ.get("PREFECT_PROFILE") or data.get("active", "ephemeral")
    return data.get("profiles", {}).get(active, {}).get("PREFECT_API_URL")


class TemporaryPrefectAPI:
    """What Prefect's ephemeral mode starts (the API on a free loopback port, UI off), started earlier.

    Prefect starts it lazily inside the first flow call, after its server module is imported into
    this process; started here, it comes up while the CLI imports the flow and DVC. Only used when
    no API is configured; PREFECT_API_URL (set when the port is chosen, before this process imports
    Prefect) points the flow at it.
    """

    SETTINGS = {"PREFECT_UI_ENABLED": "0", "PREFECT__SERVER_EPHEMERAL": "1", "PREFECT__SERVER_FINAL": "1"}

    def __init__(self) -> None:
        import socket

        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            self.port = probe.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}/api"
        self.process: subprocess.Popen | ForkedServer | None = None

    def start(self) -> None:
        """Fork the API from this process once it has imported Prefect; a fresh interpreter otherwise.

        The API imports Prefect too; forked, it shares this process's import instead of repeating it
        while both cores are busy starting the run. Forking is safe only while this process runs no other
        thread (a child inherits no threads, but any lock one held), so with another thread alive
        (Prefect's first-import telemetry in a terminal, for one) it starts a fresh interpreter.
        """
        if "prefect" in sys.modules and threading.active_count() == 1 and hasattr(os, "fork"):
            self.process = ForkedServer.start(self.port, self.SETTINGS)
        else:
            env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}
            self.process = subprocess.Popen([sys.executable, "-m", "pipelines.warmup", "serve-prefect-api",
                                             str(self.port)], env={**env, **self.SETTINGS}, stdin=subprocess.DEVNULL,
                                            start_new_session=True)

    def wait_ready(self, timeout_s: float = 120.0) -> None:
        import time
        import urllib.request

        if self.process is None:
            raise RuntimeError("the temporary Prefect API was never started")
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"the temporary Prefect API exited with {self.process.returncode} while starting")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=2) as response:
                    if response.status == 200:
                        return
            except OSError:
                time.sleep(0.02)  # the flow waits on this: a coarse poll adds half its period to every run
        raise RuntimeError(f"the temporary Prefect API on port {self.port} did not start in {timeout_s:.0f} s")

    def request_stop(self) -> None:
        """Ship the last logs and events, then ask the API to shut down (SIGINT: it ignores SIGTERM) without waiting
        for it."""
        import signal

        detach_api_logging()
        if self.process is not None and self.process.poll() is None:
            os.kill(self.process.pid, signal.SIGINT)

    def stop(self) -> None:
        self.request_stop()
        if self.process is None:
            return
        try:
            self.process.wait(timeout=15)
        except Exception:  # noqa: BLE001
            self.process.kill()


class ForkedServer:
    """The temporary API forked from the CLI: `serve_prefect_api` in a child, and the part of
    `subprocess.Popen`'s interface that TemporaryPrefectAPI uses."""

    def __init__(self, pid: int) -> None:
        self.pid, self.returncode = pid, None

    @classmethod
    def start(cls, port: int, settings: dict[str, str]) -> ForkedServer:
        sys.stdout.flush()
        sys.stderr.flush()
        parent = os.getpid()
        pid = os.fork()
        if pid:
            return cls(pid)
        code = 1
        try:  # the child: never returns into the CLI's frames
            import signal

            from components.runtime.stage_server import die_with_parent

            die_with_parent(signal.SIGINT)  # it also holds the CLI's inherited run lock: it must not outlive the CLI
            if os.getppid() != parent:  # the CLI exited before the death signal was armed
                os._exit(0)
            os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
            os.setsid()  # a terminal's Ctrl-C must not stop the API while the CLI still reports to it
            signal.signal(signal.SIGINT, signal.SIG_DFL)  # uvicorn installs its own once it serves
            os.environ.update(settings)
            serve_prefect_api(port)
            code = 0
        except BaseException:  # noqa: BLE001 - reported like an uncaught exception, then the child exits
            import traceback

            traceback.print_exc()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)

    def poll(self) -> int | None:
        if self.returncode is None:
            done, status = os.waitpid(self.pid, os.WNOHANG)
            if done:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float) -> int:
        import time

        deadline = time.monotonic() + timeout
        while self.poll() is None:
            if time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"temporary Prefect API (pid {self.pid})", timeout)
            time.sleep(0.01)
        return self.returncode

    def kill(self) -> None:
        self._signal("SIGKILL")

    def _signal(self, name: str) -> None:
        import signal

        if self.poll() is None:
            os.kill(self.pid, getattr(signal, name))


def flow_settings(api: TemporaryPrefectAPI | None) -> contextlib.AbstractContextManager:
    """Prefect settings for a flow run against this run's own temporary API: no flow-run heartbeats.

    Heartbeats let a long-lived Prefect server mark a run whose process died as crashed. The temporary
    API stops with this process, so nothing would ever read them; and the engine's heartbeat thread,
    which sleeps in one-second steps, is joined when the flow ends, which held every run's finish. Against a
    configured server they stay on.
    """
    if api is None:
        return contextlib.nullcontext()
    from prefect.settings import PREFECT_FLOWS_HEARTBEAT_FREQUENCY, temporary_settings

    return temporary_settings(updates={PREFECT_FLOWS_HEARTBEAT_FREQUENCY: None})


def serve_prefect_api(port: int) -> None:
    """The temporary API's process: what `uvicorn --factory prefect.server.api.server:create_app` runs.

    Started this way so the server's import and app set-up run with the garbage collector off
    (components.runtime.stage_server.imports_without_collection); the app is the same, built by Prefect's
    own factory.
    """
    import signal

    from components.runtime.stage_server import imports_without_collection

    with imports_without_collection():
        import uvicorn
        import uvicorn.server
        from prefect.server.api.server import create_app

        app = create_app()
    # It stops when the CLI asks (SIGINT) or exits (the death signal): a SIGTERM meant for the run (`kill`, systemd
    # stopping a service, `pkill -f grpo-pipeline`) reaches the CLI too, which ends the run through this API.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    uvicorn.server.HANDLED_SIGNALS = (signal.SIGINT,)
    quiet_shutdown_resets()
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="error", lifespan="on")


def quiet_shutdown_resets() -> None:
    """`ShutdownResets` on the logger of every SQLAlchemy pool class (each logs through one named after it)."""
    import sqlalchemy.pool

    for pool in vars(sqlalchemy.pool).values():
        if isinstance(pool, type) and issubclass(pool, sqlalchemy.pool.Pool):
            logger = logging.getLogger(f"{pool.__module__}.{pool.__name__}")
            if not any(isinstance(f, ShutdownResets) for f in logger.filters):
                logger.addFilter(ShutdownResets())


class ShutdownResets(logging.Filter):
    """Drops SQLAlchemy's report of a pooled connection whose reset the API's own shutdown cut short
    (`asyncio.CancelledError` while a request gives its session back): the temporary API stops when its run ends, so
    that traceback on the user's terminal after a stopped run is noise, not an error. Every other record passes."""

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        return not (record.name.startswith("sqlalchemy.pool") and isinstance(error, asyncio.CancelledError))


def detach_api_logging() -> None:
    """Send the run's last log lines and events to the API, then stop sending logs: the API is going away.

    Without this, Prefect's log worker retries lines logged after the API stopped until the process
    exits, which held a finished run's exit for a long time.
    """
    import logging

    if "prefect.logging.handlers" not in sys.modules:
        return
    from prefect.events.worker import EventsWorker
    from prefect.logging.handlers import APILogHandler, APILogWorker

    for worker in (APILogWorker, EventsWorker):
        try:
            worker.drain_all(timeout=5)
        except Exception:  # noqa: BLE001 - logs and events are best effort; the run itself is finished
            pass
    loggers = [logging.getLogger()] + [logger for logger in logging.Logger.manager.loggerDict.values()
                                       if isinstance(logger, logging.Logger)]
    for logger in loggers:
        for handler in [h for h in logger.handlers if isinstance(h, APILogHandler)]:
            logger.removeHandler(handler)


def plan_prefect_api() -> TemporaryPrefectAPI | None:
    """A temporary API for this run unless one is configured or ephemeral mode is switched off.

    Only its port is chosen here, so PREFECT_API_URL is set before Prefect is first imported (Prefect
    reads it then); `start()` follows once the CLI has imported Prefect.
    """
    if configured_prefect_api():
        return None
    if os.environ.get("PREFECT_SERVER_EPHEMERAL_ENABLED", "").lower() in ("0", "false"):
        return None
    api = TemporaryPrefectAPI()
    os.environ["PREFECT_API_URL"] = api.url
    return api


def open_tracking_store(root: Path, experiment: str) -> threading.Thread:
    """Create (the first time) the MLflow store's schema and the experiment, in the warm stage server.

    Asked for first thing: the server answers once MLflow is imported, while this process is still
    importing Prefect, so the flow's parent run later finds the store ready. Errors are left to the
    flow's own first MLflow call, which reports them.
    """
    from components.runtime.parent_run import run_job
    from components.tracking.runs import tracking_uri

    os.environ.setdefault("MLFLOW_TRACKING_URI", tracking_uri(root))

    def open_store() -> None:
        try:
            run_job({"action": "open", "experiment": experiment})
        except Exception:  # noqa: BLE001 - reported by the flow's parent run, with its context
            pass

    thread = threading.Thread(target=open_store, name="mlflow-store-open", daemon=True)
    thread.start()
    return thread


if __name__ == "__main__":
    if sys.argv[1:2] == ["serve-prefect-api"] and len(sys.argv) == 3:
        import signal

        from components.runtime.stage_server import die_with_parent

        die_with_parent(signal.SIGINT)
        serve_prefect_api(int(sys.argv[2]))
    else:
        sys.exit("usage: python -m pipelines.warmup serve-prefect-api PORT")
