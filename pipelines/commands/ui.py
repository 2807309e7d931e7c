"""`grpo-pipeline ui mlflow|prefect`: the MLflow or the Prefect UI of this repository's runs, on this machine,
with the settings the pipeline itself runs with (telemetry off: components/quiet.py).

- mlflow: `mlflow ui` on the store the pipeline logs to (MLFLOW_TRACKING_URI, else ./mlflow.db), one worker.
  With a tracking server configured there is nothing to start: its own address is the UI.
- prefect: `prefect server start` on Prefect's database (PREFECT_HOME, ~/.prefect by default), which holds
  every flow run so far: a run without a server records itself there through its temporary API.

Runs in the foreground until Ctrl-C.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
from pathlib import Path

from components.tracking.runs import tracking_uri

DEFAULT_PORTS = {"mlflow": 5000, "prefect": 4200}


def command(which: str, root: Path, host: str, port: int) -> tuple[list[str], dict[str, str]] | str:
    """The UI's command line and extra environment, or the address of a configured tracking server."""
    if which == "mlflow":
        store = tracking_uri(root)
        if store.startswith(("http://", "https://", "databricks")):
            return store
        # One worker and no job runner: the defaults start 4 workers and job processes (~2.6 GB on 2 cores).
        return ([_tool("mlflow"), "ui", "--backend-store-uri", store, "--host", host, "--port", str(port),
                 "--workers", "1"], {"MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"})
    return [_tool("prefect"), "server", "start", "--host", host, "--port", str(port), "--analytics-off"], {}


def _tool(name: str) -> str:
    """The tool beside this interpreter (the project's venv), else on PATH."""
    beside = Path(sys.executable).parent / name
    return str(beside) if beside.exists() else (shutil.which(name) or name)


def cmd_ui(args: argparse.Namespace) -> int:
    port = args.port or DEFAULT_PORTS[args.which]
    found = command(args.which, Path(args.root).resolve(), args.host, port)
    if isinstance(found, str):
        print(f"MLflow UI: {found} (MLFLOW_TRACKING_URI names a tracking server; open its address)")
        return 0
    argv, extra = found
    print(f"{args.which} UI at http://{args.host}:{port} (telemetry off; Ctrl-C stops it)", flush=True)
    try:
        return subprocess.call(argv, cwd=args.root, env={**os.environ, **extra})
    except KeyboardInterrupt:
        return 130
