"""`grpo-pipeline evaluate-many`: the held-out reward of several checkpoints at once, and their table."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from components.config import ConfigError
from components.data.model_source import ModelLoadError
from components.data.records import DataError


def cmd_evaluate_many(args: argparse.Namespace) -> int:
    # Prefect's temporary API must answer within its start-up timeout (20 s by default; read when Prefect is
    # imported): on a loaded 2-core machine it took longer, and the command failed before evaluating anything.
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")
    from pipelines.evaluate_many import evaluate_many, table  # imports Prefect: only after the line above

    try:
        results = evaluate_many(args.checkpoints, root=args.root, params=args.params_file, runner=args.runner,
                                workers=args.workers)
    except (ConfigError, DataError, ModelLoadError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(table(results))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        report = {"runner": args.runner, "cli_pid": os.getpid(), "results": results}
        Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
        print(f"per-prompt results: {args.out}")
    return 0
