"""`grpo-pipeline reproduce`: re-run a registered version from its commit, data and params, and compare."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from pipelines.reproduce import reproduce


def cmd_reproduce(args: argparse.Namespace) -> int:
    if (args.version is None) == (args.run_id is None):
        print("error: give a VERSION or --run-id", file=sys.stderr)
        return 2
    os.environ.setdefault("MLFLOW_TRACKING_URI", f"sqlite:///{Path(args.root).resolve() / 'mlflow.db'}")
    try:
        report = reproduce(Path(args.root).resolve(), args.name, args.version, args.run_id, keep=args.keep)
    except (RuntimeError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(report.table())
    return 0 if report.match else 1
