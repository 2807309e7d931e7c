"""`grpo-pipeline serve`, `deploy`, `setup` and `data update`: the pipeline as a Prefect deployment, its data."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from components.config import ConfigError, load_config
from components.config.loading import load_yaml
from pipelines.operations import deploy, serve, setup, update_data
from pipelines.params_io import merged_config


def _param_overrides(assignments: list[str]) -> dict[str, object]:
    """`--param key=value` (repeatable) as deployment parameters {"key": value}; values parsed as YAML."""
    out: dict[str, object] = {}
    for item in assignments:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"--param {item}: expected KEY=VALUE, e.g. grpo.kl_beta=0.1")
        out[key.strip()] = load_yaml(value)  # as params.yaml is read: `1e-5` is a number
    return out


def _validated(root: Path, overrides: dict[str, object]):
    """params.yaml with the deployment overrides applied, validated (nothing written)."""
    # pipelines.flow imports Prefect: imported here, so that `data update --no-emit` does without it
    from pipelines.flow import override_list

    return merged_config(root / "params.yaml", [], override_list(overrides))


def cmd_serve(args: argparse.Namespace) -> int:
    root = Path(args.root).resolve()
    try:
        overrides = _param_overrides(args.param)
        _validated(root, overrides)
    except (ConfigError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    serve(root, args.cron, args.interval, overrides, name=args.name, limit=args.limit)
    return 0


def cmd_deploy(args: argparse.Namespace) -> int:
    root = Path(args.root).resolve()
    try:
        overrides = _param_overrides(args.param)
        _validated(root, overrides)
        job_variables = json.loads(args.job_variables) if args.job_variables else {}
    except (ConfigError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    deployment_id = deploy(root, args.pool, args.pool_type, args.cron, overrides, job_variables, name=args.name)
    print(f"deployment {deployment_id} registered on work pool '{args.pool}'; start a worker with: "
          f"prefect worker start --pool {args.pool}")
    return 0


def cmd_setup(args: argparse.Namespace) -> int:
    limit = setup(load_config(Path(args.root).resolve() / "params.yaml"))
    print(f"concurrency limit for tag 'gpu': {limit} task run(s) at once")
    return 0


def cmd_data_update(args: argparse.Namespace) -> int:
    try:
        info = update_data(Path(args.root).resolve(), Path(args.path), args.split, emit=not args.no_emit)
    except (ConfigError, ValueError, RuntimeError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"{info['path']} updated (md5 {info['md5']}), recorded with DVC"
          + ("" if args.no_emit else "; event grpo.dataset.updated emitted"))
    return 0


DATA_COMMANDS = {"update": cmd_data_update}


def cmd_data(args: argparse.Namespace) -> int:
    """`grpo-pipeline data SUBCOMMAND`."""
    return DATA_COMMANDS[args.data_command](args)
