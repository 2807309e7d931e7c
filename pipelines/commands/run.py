"""`grpo-pipeline run`: one run per repository (its lock), with the warm stage server and the temporary
Prefect API started around the config checks and the flow (pipelines/commands/run_flow.py)."""

from __future__ import annotations

import argparse
import os
import signal
import sys
from pathlib import Path

from components.locks import LOCK_HELD_ENV, PIPELINE_LOCK, LockBusy, file_lock
from components.runtime.stage_client import server_accepts
from components.runtime.stage_server import SERVER_ENV, start_server, stop_server
from pipelines import warmup


def cmd_run(args: argparse.Namespace) -> int:
    root = Path(args.root).resolve()
    # A write the device refuses as too large (RLIMIT_FSIZE; what a full or small filesystem answers) fails with
    # an error each writer reports (a checkpoint, DVC's cache) instead of killing the process that made it.
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    if args.dry_run:
        return _run_locked(args)
    try:  # one run per repository: held across writing params.yaml and the whole flow
        with file_lock(root / PIPELINE_LOCK, "a pipeline run in this repository"):
            os.environ[LOCK_HELD_ENV] = str(os.getpid())
            return _run_locked(args)
    except LockBusy as err:
        print(f"error: {err}", file=sys.stderr)
        return 3


def _run_locked(args: argparse.Namespace) -> int:
    root = Path(args.root).resolve()
    server = api = None
    if not args.dry_run:
        # First thing, before Prefect is imported: the warm stage interpreter starts while the CLI
        # checks the config, and the temporary Prefect API's address is chosen (pipelines/warmup.py).
        # A server named in the environment that would run this run's stages is used instead, as the flow uses it
        # (the test suite keeps one per worker); it is not this run's to stop.
        if not server_accepts(os.environ.get(SERVER_ENV)):
            server = start_server(str(root))
            os.environ[SERVER_ENV] = server[1]
        api = warmup.plan_prefect_api()
    try:
        # Imported only now: its imports (the config's, the params files') overlap the stage server's start-up.
        from pipelines.commands.run_flow import check_and_run

        return check_and_run(args, root, api)
    finally:
        if server is not None:
            server[0].terminate()  # both stop side by side
            os.environ.pop(SERVER_ENV, None)
        if api is not None:
            api.stop()
            os.environ.pop("PREFECT_API_URL", None)
        if server is not None:
            stop_server(*server)
