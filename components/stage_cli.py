"""Shared command-line entry for the stage modules (`python -m components.<stage>`)."""

from __future__ import annotations

import argparse
import sys
from typing import Callable

from components.config import ConfigError, PipelineConfig, load_config


class StageFailed(RuntimeError):
    """A stage refused its inputs; the message is the whole report a user needs."""


def stage_main(description: str, run: Callable[[PipelineConfig], object], argv: list[str] | None = None) -> int:
    """Parse `--params`/`--set`, run the stage, and turn known failures into one clear line + exit 1."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--params", default="params.yaml", help="params file (default: params.yaml)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override one params key, e.g. --set grpo.kl_beta=0.1")
    args = parser.parse_args(argv)
    from components.data import DataError
    from components.modeling import ModelLoadError

    try:
        cfg = load_config(args.params, args.overrides)
        run(cfg)
    except (ConfigError, DataError, ModelLoadError, StageFailed) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    return 0
