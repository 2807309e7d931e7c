"""`grpo-pipeline promote`, `rollback` and `compare`: the model registry and the pipeline runs by hand."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from pathlib import Path

from components.config import load_config
from components.locks import REGISTRY_LOCK, file_lock
from components.tracking.registry import RegistryRefused, compare_table, pipeline_runs, promote, rollback
from components.tracking.runs import client


def _registry_client(root: str):
    os.environ.setdefault("MLFLOW_TRACKING_URI", f"sqlite:///{Path(root).resolve() / 'mlflow.db'}")
    return client()


def _move_champion(args: argparse.Namespace, move: Callable[[object], dict]) -> int:
    """`move(client)` under the registry lock, and one line saying where the champion went."""
    try:
        with file_lock(Path(args.root).resolve() / REGISTRY_LOCK, "a registry change in this repository", wait_s=60):
            record = move(_registry_client(args.root))
    except RegistryRefused as err:
        print(f"refused: {err}", file=sys.stderr)
        return 2
    print(f"{args.name}: champion moved from v{record['from']} to v{record['to']} by {record['who']} at "
          f"{record['when']} ({record['why']})")
    return 0


def cmd_promote(args: argparse.Namespace) -> int:
    return _move_champion(args, lambda c: promote(c, args.name, args.version, args.reason or "manual promotion"))


def cmd_rollback(args: argparse.Namespace) -> int:
    return _move_champion(args, lambda c: rollback(c, args.name, args.reason or "manual rollback"))


def cmd_compare(args: argparse.Namespace) -> int:
    registry = _registry_client(args.root)
    experiment = args.experiment or load_config(Path(args.root).resolve() / "params.yaml").tracking.experiment
    try:
        print(compare_table(pipeline_runs(registry, experiment, args.run_ids, args.last)))
    except RegistryRefused as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0
