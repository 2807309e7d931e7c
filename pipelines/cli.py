"""`grpo-pipeline`: the user-facing command, a table of subcommands. Only the chosen subcommand's module
(pipelines/commands/) is imported, when it runs, so `--help` and start-up stay fast."""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from pathlib import Path

# Read by glibc when a process starts, so it reaches the stage processes: large allocations on transparent
# huge pages where the kernel offers them (components/engine/grpo/host_memory.py).
ALLOCATOR_DEFAULTS = {"GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"}


def _run_arguments(run: argparse.ArgumentParser) -> None:
    run.add_argument("--root", default=".", help="repository root holding params.yaml and dvc.yaml")
    run.add_argument("--verbose", action="store_true", help="print a failure's traceback here too (always in logs/)")
    run.add_argument("--params", action="append", default=[], metavar="FILE",
                     help="overlay a (partial) params file onto params.yaml; repeatable")
    run.add_argument("--preset", help="overlay configs/presets/NAME.yaml")
    run.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                     help="override one params key, e.g. --set grpo.kl_beta=0.1; repeatable")
    run.add_argument("--persist", action="store_true",
                     help="keep this run's --set/--params/--preset in params.yaml for later runs (default: this "
                          "run only; the next run without overrides goes back to your own params.yaml)")
    run.add_argument("--dry-run", action="store_true",
                     help="validate config, data and model, run one rollout and one loss; train and write nothing")


def _stage_arguments(stage: argparse.ArgumentParser) -> None:
    from components.runtime.stage_server import STAGE_MODULES  # standard library only: start-up stays fast

    stage.add_argument("name", choices=list(STAGE_MODULES))
    stage.add_argument("--params", dest="params_file", default="params.yaml")
    stage.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")


def _reproduce_arguments(repro: argparse.ArgumentParser) -> None:
    repro.add_argument("name", help="registered model name")
    repro.add_argument("version", nargs="?", help="version number (or give --run-id)")
    repro.add_argument("--run-id", help="the MLflow run that registered the version")
    repro.add_argument("--root", default=".", help="repository root")
    repro.add_argument("--keep", action="store_true", help="keep the temporary worktree for inspection")


def _deployment_arguments(p: argparse.ArgumentParser) -> None:
    """What `serve` and `deploy` share."""
    p.add_argument("--root", default=".", help="repository root")
    p.add_argument("--cron", help="cron schedule (default: operations.cron in params.yaml)")
    p.add_argument("--name", help="deployment name (default: operations.deployment)")
    p.add_argument("--param", action="append", default=[], metavar="KEY=VALUE",
                   help="deployment parameter overriding a params key, e.g. grpo.kl_beta=0.1; repeatable")


def _serve_arguments(serve: argparse.ArgumentParser) -> None:
    _deployment_arguments(serve)
    serve.add_argument("--interval", type=float, metavar="SECONDS", help="run every SECONDS instead of a cron")
    serve.add_argument("--limit", type=int, help="most runs this process executes at once")


def _deploy_arguments(deploy: argparse.ArgumentParser) -> None:
    _deployment_arguments(deploy)
    deploy.add_argument("--pool", default="grpo-process", help="work pool (created as --pool-type if missing)")
    deploy.add_argument("--pool-type", default="process",
                        help="type of a pool created here: process, docker, kubernetes")
    deploy.add_argument("--job-variables", help='JSON job variables, e.g. \'{"image": "my/grpo:1"}\'')


def _setup_arguments(setup: argparse.ArgumentParser) -> None:
    setup.add_argument("--root", default=".", help="repository root")


def _data_arguments(data: argparse.ArgumentParser) -> None:
    data_sub = data.add_subparsers(dest="data_command", required=True)
    update = data_sub.add_parser("update", help="copy a new dataset in, record it with DVC, emit grpo.dataset.updated")
    update.add_argument("path", help="the new dataset file")
    update.add_argument("--split", default="train", choices=["train", "heldout", "sft"])
    update.add_argument("--root", default=".", help="repository root")
    update.add_argument("--no-emit", action="store_true", help="do not emit the event")


def _promote_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("name")
    p.add_argument("version")
    _champion_arguments(p)


def _rollback_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("name")
    _champion_arguments(p)


def _champion_arguments(p: argparse.ArgumentParser) -> None:
    """What `promote` and `rollback` share."""
    p.add_argument("--reason", help="why (recorded with who and when)")
    p.add_argument("--root", default=".", help="repository root (registry lock, default store)")


def _compare_arguments(compare: argparse.ArgumentParser) -> None:
    compare.add_argument("run_ids", nargs="*", help="MLflow run ids of pipeline runs (default: the --last N)")
    compare.add_argument("--last", type=int, default=5, help="the N newest pipeline runs")
    compare.add_argument("--experiment", help="experiment (default: tracking.experiment)")
    compare.add_argument("--root", default=".", help="repository root")


def _evaluate_many_arguments(many: argparse.ArgumentParser) -> None:
    many.add_argument("checkpoints", nargs="+", metavar="CHECKPOINT",
                      help="model directories (models/grpo) or training checkpoints (checkpoints/grpo/step-N)")
    many.add_argument("--root", default=".", help="repository root (data/prepared, models/sft, params.yaml)")
    many.add_argument("--params", dest="params_file", default="params.yaml")
    many.add_argument("--runner", choices=["process", "thread", "ray", "sequential"], default="process",
                      help="Prefect task runner: process pool (default), thread pool, Ray (prefect-ray), or none")
    many.add_argument("--workers", type=int, help="parallel workers (default: one per checkpoint)")
    many.add_argument("--out", help="write every checkpoint's metrics and per-prompt results to this JSON file")


def _ui_arguments(ui: argparse.ArgumentParser) -> None:
    ui.add_argument("which", choices=["mlflow", "prefect"])
    ui.add_argument("--host", default="127.0.0.1", help="address to listen on (default: this machine only)")
    ui.add_argument("--port", type=int, help="port (default: 5000 for mlflow, 4200 for prefect)")
    ui.add_argument("--root", default=".", help="repository root (its mlflow.db)")


# The subcommands, in --help's order: name, help, what adds its arguments, and "module:function" that runs it.
COMMANDS = [
    ("run", "run the whole pipeline as a Prefect flow (DVC decides what is stale)",
     _run_arguments, "pipelines.commands.run:cmd_run"),
    ("stage", "run one stage directly, outside Prefect and DVC",
     _stage_arguments, "pipelines.commands.stage:cmd_stage"),
    ("reproduce", "re-run a registered version from its commit, data and params; compare",
     _reproduce_arguments, "pipelines.commands.reproduce:cmd_reproduce"),
    ("serve", "serve the pipeline as a Prefect deployment: schedule + data-update trigger",
     _serve_arguments, "pipelines.commands.operations:cmd_serve"),
    ("deploy", "register the deployment on a Prefect work pool",
     _deploy_arguments, "pipelines.commands.operations:cmd_deploy"),
    ("setup", "create the Prefect `gpu` concurrency limit (operations.gpu_concurrency)",
     _setup_arguments, "pipelines.commands.operations:cmd_setup"),
    ("data", "dataset operations",
     _data_arguments, "pipelines.commands.operations:cmd_data"),
    ("promote", "move the champion alias to VERSION (refused if not comparable)",
     _promote_arguments, "pipelines.commands.registry:cmd_promote"),
    ("rollback", "give the champion alias back to the previous champion",
     _rollback_arguments, "pipelines.commands.registry:cmd_rollback"),
    ("compare", "table of pipeline runs: differing params, rewards, data, durations",
     _compare_arguments, "pipelines.commands.registry:cmd_compare"),
    ("evaluate-many", "held-out reward of several checkpoints at once (Prefect task runner)",
     _evaluate_many_arguments, "pipelines.commands.evaluate_many:cmd_evaluate_many"),
    ("ui", "open the MLflow UI (runs, registry) or the Prefect UI (flow runs) of this repository, telemetry off",
     _ui_arguments, "pipelines.commands.ui:cmd_ui"),
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="grpo-pipeline", description="GRPO fine-tuning pipeline.")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, help_text, add_arguments, _ in COMMANDS:
        add_arguments(sub.add_parser(name, help=help_text))
    return parser


def main(argv: list[str] | None = None) -> int:
    from components.quiet import quiet_libraries  # os only; imported here, so `import pipelines.cli` stays bare

    quiet_libraries()
    for key, value in ALLOCATOR_DEFAULTS.items():
        os.environ.setdefault(key, value)
    args = build_parser().parse_args(argv)
    root = getattr(args, "root", None)
    if root is not None and not (Path(root) / "params.yaml").exists():
        where = Path(root).resolve()
        print(f"error: {where} is not a grpo-pipeline repository (no params.yaml there); run the command from the "
              "repository's folder or pass --root PATH_TO_REPOSITORY", file=sys.stderr)
        return 2
    module, function = next(path for name, _, _, path in COMMANDS if name == args.command).split(":")
    code = getattr(importlib.import_module(module), function)(args)
    if argv is None and args.command == "run" and not args.dry_run:
        # The command line's own run: everything is written and the servers are stopped; with Prefect's
        # logs and events drained, tearing down the interpreter's modules (Prefect, MLflow, DVC,
        # pandas) would only add 1-2 s.
        from pipelines.warmup import detach_api_logging  # already imported by the run command

        detach_api_logging()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


if __name__ == "__main__":
    sys.exit(main())
