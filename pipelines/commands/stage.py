"""`grpo-pipeline stage NAME`: one stage directly, outside Prefect and DVC."""

from __future__ import annotations

import argparse
import importlib

from components.runtime.stage_server import STAGE_MODULES


def cmd_stage(args: argparse.Namespace) -> int:
    module = importlib.import_module(f"components.{STAGE_MODULES[args.name]}")
    argv = ["--params", args.params_file] + [x for s in args.overrides for x in ("--set", s)]
    return module.main(argv)
