"""`grpo-pipeline`: the user-facing command. Heavy libraries are imported inside each command."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

QUIET_DEFAULTS = {
    "MLFLOW_DISABLE_TELEMETRY": "true",
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    "DVC_NO_ANALYTICS": "1",
    "GX_ANALYTICS_ENABLED": "false",
    "HF_HUB_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
}


def _cmd_run(args: argparse.Namespace) -> int:
    from components.locks import LOCK_HELD_ENV, PIPELINE_LOCK, LockBusy, file_lock

    root = Path(args.root).resolve()
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
    from components.config import ConfigError
    from components.data import DataError
    from components.modeling import ModelLoadError
    from components.stage_cli import StageFailed
    from pipelines.params_io import apply_to_params, merged_config, preset_path

    root = Path(args.root).resolve()
    params = root / "params.yaml"
    try:
        overlays = ([preset_path(args.preset)] if args.preset else []) + [Path(p) for p in args.params]
        cfg = merged_config(params, overlays, args.overrides)
        if cfg.model.name_or_path:  # fail before any stage starts, with the offline hint for hub ids
            from components.modeling import check_model_source

            os.chdir(root)
            check_model_source(cfg.model.name_or_path, cfg.model.allow_download)
        if args.dry_run:
            from components.dry_run import dry_run

            os.chdir(root)
            dry_run(cfg)
            return 0
        if apply_to_params(params, overlays, args.overrides):
            print(f"params.yaml updated with the run's settings (git diff {params.name} shows them)")
    except (ConfigError, ValueError, DataError, ModelLoadError, StageFailed) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    from pipelines.flow import grpo_pipeline

    try:
        result = grpo_pipeline(root=str(root))
    except Exception as err:  # noqa: BLE001 - the stage's own message is the report
        print(f"\npipeline failed: {err}", file=sys.stderr)
        return 1
    ev, reg = result["evaluation"], result["registration"]
    imp = ev["improvement"]
    print("\n" + "=" * 72)
    print(f"held-out mean reward before GRPO: {ev['baseline']['mean_reward']:.4f}")
    print(f"held-out mean reward after GRPO:  {ev['candidate']['mean_reward']:.4f}  "
          f"(improvement {imp['mean']:+.4f}, 95% CI {imp['ci95_low']:+.4f} .. {imp['ci95_high']:+.4f}, n={ev['n']})")
    print(f"registered model: {reg['model_uri']} -> {'champion' if reg['promoted'] else 'challenger'} "
          f"({reg['reason']})")
    print(f"load it with: mlflow.pyfunc.load_model('{reg['champion_uri']}')")
    print("=" * 72)
    return 0


def _cmd_stage(args: argparse.Namespace) -> int:
    import importlib

    modules = {"prepare": "prepare", "model": "base_model", "validate": "validate", "sft": "sft", "grpo": "grpo",
               "evaluate": "evaluate", "register": "register"}
    module = importlib.import_module(f"components.{modules[args.name]}")
    argv = ["--params", args.params_file] + [x for s in args.overrides for x in ("--set", s)]
    return module.main(argv)


def _cmd_reproduce(args: argparse.Namespace) -> int:
    from pipelines.reproduce import reproduce

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


def _cmd_evaluate_many(args: argparse.Namespace) -> int:
    import json

    from components.config import ConfigError
    from components.data import DataError
    from components.modeling import ModelLoadError
    from pipelines.evaluate_many import evaluate_many, table

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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="grpo-pipeline", description="GRPO fine-tuning pipeline.")
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run the whole pipeline as a Prefect flow (DVC decides what is stale)")
    run.add_argument("--root", default=".", help="repository root holding params.yaml and dvc.yaml")
    run.add_argument("--params", action="append", default=[], metavar="FILE",
                     help="overlay a (partial) params file onto params.yaml; repeatable")
    run.add_argument("--preset", help="overlay configs/presets/NAME.yaml")
    run.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                     help="override one params key, e.g. --set grpo.kl_beta=0.1; repeatable")
    run.add_argument("--dry-run", action="store_true",
                     help="validate config, data and model, run one rollout and one loss; train and write nothing")
    run.set_defaults(func=_cmd_run)
    stage = sub.add_parser("stage", help="run one stage directly, outside Prefect and DVC")
    stage.add_argument("name", choices=["prepare", "model", "validate", "sft", "grpo", "evaluate", "register"])
    stage.add_argument("--params", dest="params_file", default="params.yaml")
    stage.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    stage.set_defaults(func=_cmd_stage)
    repro = sub.add_parser("reproduce", help="re-run a registered version from its commit, data and params; compare")
    repro.add_argument("name", help="registered model name")
    repro.add_argument("version", nargs="?", help="version number (or give --run-id)")
    repro.add_argument("--run-id", help="the MLflow run that registered the version")
    repro.add_argument("--root", default=".", help="repository root")
    repro.add_argument("--keep", action="store_true", help="keep the temporary worktree for inspection")
    repro.set_defaults(func=_cmd_reproduce)
    many = sub.add_parser("evaluate-many", help="held-out reward of several checkpoints at once (Prefect task runner)")
    many.add_argument("checkpoints", nargs="+", metavar="CHECKPOINT",
                      help="model directories (models/grpo) or training checkpoints (checkpoints/grpo/step-N)")
    many.add_argument("--root", default=".", help="repository root (data/prepared, models/sft, params.yaml)")
    many.add_argument("--params", dest="params_file", default="params.yaml")
    many.add_argument("--runner", choices=["process", "thread", "ray", "sequential"], default="process",
                      help="Prefect task runner: process pool (default), thread pool, Ray (prefect-ray), or none")
    many.add_argument("--workers", type=int, help="parallel workers (default: one per checkpoint)")
    many.add_argument("--out", help="write every checkpoint's metrics and per-prompt results to this JSON file")
    many.set_defaults(func=_cmd_evaluate_many)
    return parser


def main(argv: list[str] | None = None) -> int:
    for key, value in QUIET_DEFAULTS.items():
        os.environ.setdefault(key, value)
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
