"""`grpo-pipeline`: the user-facing command. Heavy libraries are imported inside each command."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

_IMPORTED_AT = time.perf_counter()

# Read by glibc when a process starts, so it reaches the stage processes: large allocations on transparent
# huge pages where the kernel offers them (components/engine/host_memory.py).
ALLOCATOR_DEFAULTS = {"GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"}


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
    from components.runtime.stage_server import SERVER_ENV, start_server, stop_server
    from pipelines import warmup

    root = Path(args.root).resolve()
    server = api = None
    if not args.dry_run:
        # First thing, before Prefect is imported: the warm stage interpreter starts while the CLI
        # checks the config, and the temporary Prefect API's address is chosen (pipelines/warmup.py).
        server = start_server(str(root))
        os.environ[SERVER_ENV] = server[1]
        api = warmup.plan_prefect_api()
    try:
        return _check_and_run(args, root, api)
    finally:
        if server is not None:
            server[0].terminate()  # both stop side by side
            os.environ.pop(SERVER_ENV, None)
        if api is not None:
            api.stop()
            os.environ.pop("PREFECT_API_URL", None)
        if server is not None:
            stop_server(*server)


def _check_and_run(args: argparse.Namespace, root: Path, api) -> int:
    from components.config import ConfigError
    from components.data.model_source import ModelLoadError
    from components.data.records import DataError
    from components.errors import StageFailed
    from pipelines.params_io import merged_config, prepare_params, preset_path, user_params

    try:
        overlays = ([preset_path(args.preset)] if args.preset else []) + [Path(p) for p in args.params]
        # the user's own settings plus this run's overrides (an earlier run's overrides are not carried over)
        cfg = merged_config(user_params(root), overlays, args.overrides)
        from components.config import config_warnings

        for warning in config_warnings(cfg):
            print(f"warning: {warning}", file=sys.stderr)
        if cfg.model.name_or_path:  # fail before any stage starts, with the offline hint for hub ids
            from components.data.model_source import check_model_source

            os.chdir(root)
            check_model_source(cfg.model.name_or_path, cfg.model.allow_download, cfg.model.gguf_file)
        if args.dry_run:
            from pipelines.dry_run import dry_run

            os.chdir(root)
            dry_run(cfg)
            return 0
        from pipelines.safekeeping import WorkingCopySnapshot

        snapshot = WorkingCopySnapshot.take(root)
        described = " ".join(([f"--preset {args.preset}"] if args.preset else [])
                             + [f"--params {p}" for p in args.params] + [f"--set {o}" for o in args.overrides])
        for line in prepare_params(root, overlays, args.overrides, args.persist, described):
            print(line)
    except (ConfigError, ValueError, DataError, ModelLoadError, StageFailed) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    try:
        code = _run_flow(args, root, cfg, api)
    except BaseException:
        _undo(snapshot, None)
        raise
    if code == 0:
        snapshot.discard()
    else:
        _undo(snapshot, Path(os.environ.get("GRPO_RUN_LOG", root / "logs" / "run.log")))
    return code


def _undo(snapshot, log_file: Path | None) -> None:
    """A failed or interrupted run: its reports beside its log, then the working copy as it was."""
    kept = snapshot.keep_reports(log_file.with_suffix("")) if log_file is not None else []
    try:
        snapshot.restore()
    except Exception as err:  # noqa: BLE001 - the run's own failure stays the report
        print(f"warning: could not restore the working copy ({err}); `git checkout params.yaml dvc.lock && "
              "dvc checkout` does it by hand", file=sys.stderr)
    else:
        print("nothing the run changed was kept: params.yaml, dvc.lock and outputs are as before it "
              "(GRPO checkpoints stay, so rerunning the same command resumes)"
              + (f"; its reports: {', '.join(str(p) for p in kept)}" if kept else ""), file=sys.stderr)
    snapshot.discard()


def _run_flow(args: argparse.Namespace, root: Path, cfg, api) -> int:
    from components.runtime.stage_server import imports_without_collection
    from pipelines import warmup

    if api is not None:
        with imports_without_collection():
            import prefect  # noqa: F401 - the temporary API is forked from here and shares this import
        api.start()  # before any thread of this process starts (the store's, just below)
    store = warmup.open_tracking_store(root, cfg.tracking.experiment)
    with imports_without_collection():
        import dvc.repo  # noqa: F401 - the flow's first stage needs it; imported while the store and API start

        from pipelines.flow import grpo_pipeline
    store.join(timeout=300)  # a parent run must not race the store's first schema creation
    log_file = attach_run_log(root)
    from prefect.exceptions import CancelledRun

    from pipelines import interrupts

    interrupts.install()
    try:
        if api is not None:
            api.wait_ready()
        with warmup.flow_settings(api):
            result = grpo_pipeline(root=str(root))
        if api is not None:
            api.request_stop()  # its shutdown (~0.2 s) overlaps the report below; the caller waits for it
    except CancelledRun as stop:  # one line; the flow run is Cancelled, the checkpoints are kept
        with log_file.open("a", encoding="utf-8") as fh:
            fh.write(f"cancelled: {stop}\n")
        print(f"\n{stop}", file=sys.stderr)
        return interrupts.exit_code()
    except Exception as err:  # noqa: BLE001 - the stage's own message is the report
        import traceback

        with log_file.open("a", encoding="utf-8") as fh:
            fh.write(traceback.format_exc() + "\n" + getattr(err, "detail", "") + "\n")
        if getattr(args, "verbose", False):
            traceback.print_exc()
        print(f"\nerror: {err}\n(full log with the traceback: {log_file})", file=sys.stderr)
        return 1
    finally:
        interrupts.uninstall()
    ev, reg = result["evaluation"], result["registration"]
    imp = ev["improvement"]
    print("\n" + "=" * 72)
    print(f"held-out mean reward before GRPO: {ev['baseline']['mean_reward']:.4f}")
    print(f"held-out mean reward after GRPO:  {ev['candidate']['mean_reward']:.4f}  "
          f"(improvement {imp['mean']:+.4f}, 95% CI {imp['ci95_low']:+.4f} .. {imp['ci95_high']:+.4f}, n={ev['n']})")
    print(band_report(root, cfg, ev))
    print(f"registered model: {reg['model_uri']} -> {'champion' if reg['promoted'] else 'challenger'} "
          f"({reg['reason']})")
    print(f"load it with: mlflow.pyfunc.load_model('{reg['champion_uri']}')")
    if any(not stage["skipped"] for stage in result["stages"]):  # DVC's own hint came once per stage
        print("record the run in git: git add -f dvc.lock params.yaml metrics plots && git commit")
    report_overhead(result)
    print("=" * 72)
    return 0


def attach_run_log(root: Path) -> Path:
    """Where this run's full log goes (logs/run-<time>.log): the flow attaches it once Prefect has set
    up its logging (pipelines/flow.py `quiet_stage_errors`), so tracebacks land there, not on screen."""
    from pipelines.flow import RUN_LOG_ENV

    path = root / "logs" / time.strftime("run-%Y%m%d-%H%M%S.log")
    path.parent.mkdir(exist_ok=True)
    path.touch()
    os.environ[RUN_LOG_ENV] = str(path)
    return path


def band_report(root: Path, cfg, evaluation: dict) -> str:
    """This run's result next to the band benchmarks/seed_spread.py measured for the default, and a
    plain word when it falls outside (with the likely reasons)."""
    from components.config import default_fingerprint

    spread = root / "benchmarks" / "results" / "seed_spread.json"
    if not spread.exists():
        return "expected band: none recorded (benchmarks/results/seed_spread.json is missing)"
    measured = json.loads(spread.read_text())
    if measured.get("default_fingerprint") != default_fingerprint(cfg):
        return "expected band: measured for the embedded default only; these params differ from it"
    all_runs = measured["summary"]["all"]
    warm, imp = all_runs["warm_start"], all_runs["improvement"]
    ours_warm, ours_imp = evaluation["baseline"]["mean_reward"], evaluation["improvement"]["mean"]
    lines = [f"expected on the default ({all_runs['runs']} runs: seeds {', '.join(map(str, measured['seeds']))} x "
             f"kernel settings {' and '.join(measured['kernels'])}, on {measured['machine']['cpu']}): warm start "
             f"{warm['min']:.3f} .. {warm['max']:.3f}, improvement {imp['min']:+.3f} .. {imp['max']:+.3f}"]
    outside = [name for name, value, band in (("warm start", ours_warm, warm), ("improvement", ours_imp, imp))
               if not band["min"] <= value <= band["max"]]
    if outside:
        lines.append(f"OUTSIDE the expected band ({' and '.join(outside)}). Likely reasons: another CPU kind or "
                     "kernel path than the runs above (other rounding; see README 'What reproduced means'), another "
                     "thread count, or a changed lock file; the seed alone moved it by less than the band.")
    else:
        lines.append("within the expected band")
    return "\n".join(lines)


def process_age_seconds() -> float:
    """Seconds since this process started (Linux /proc), so the figure includes interpreter start-up."""
    try:
        with open("/proc/self/stat") as fh:
            start_ticks = int(fh.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as fh:
            uptime = float(fh.read().split()[0])
        return uptime - start_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return time.perf_counter() - _IMPORTED_AT


def overhead_breakdown(stage_times: list[dict], process_started: float) -> dict[str, float]:
    """Split the overhead by when it happened, from the stages' wall-clock stamps (components/stages/cli.py).

    before first stage: CLI start-up, config checks, Prefect API, MLflow parent run, first DVC check;
    stage warm-ups: each stage's imports and tracking-store connection; between stages: Prefect task
    runs and DVC's hashing and dvc.lock writes; after last stage: reports, artifacts and shutdown.
    """
    stamped = [t for t in stage_times if "entered" in t]
    if not stamped:
        return {}
    now = time.time()
    between = sum(b["entered"] - a["ended_at"] for a, b in zip(stamped, stamped[1:]))
    return {"before_first_stage": round(stamped[0]["entered"] - process_started, 2),
            "stage_warm_ups": round(sum(t["started_at"] - t["entered"] for t in stamped), 2),
            "between_stages": round(between, 2),
            "after_last_stage": round(now - stamped[-1]["ended_at"], 2)}


def report_overhead(result: dict) -> dict[str, float]:
    """Print and log what the run spent outside the stages' own compute (Prefect, MLflow, DVC, start-up)."""
    wall = process_age_seconds()
    compute = sum(t["compute_seconds"] for t in result.get("stage_compute", []))
    figures = {"pipeline.wall_seconds": round(wall, 2), "pipeline.compute_seconds": round(compute, 2),
               "pipeline.overhead_seconds": round(wall - compute, 2),
               "pipeline.overhead_share": round((wall - compute) / wall, 4) if wall > 0 else 0.0}
    print(f"orchestration overhead: {wall - compute:.1f} s of {wall:.1f} s wall "
          f"({figures['pipeline.overhead_share']:.1%}); stages' own compute {compute:.1f} s")
    breakdown = overhead_breakdown(result.get("stage_compute", []), time.time() - wall)
    if breakdown:
        figures.update({f"pipeline.overhead_{k}_seconds": v for k, v in breakdown.items()})
        print("  where: " + ", ".join(f"{k.replace('_', ' ')} {v:.1f} s" for k, v in breakdown.items()))
    try:
        from pipelines.flow import ParentRun

        ParentRun(result["parent_run_id"], "").update(metrics=figures)
    except Exception as err:  # noqa: BLE001 - a report, never a reason to fail a finished run
        print(f"(overhead figures not logged to MLflow: {err})", file=sys.stderr)
    return figures


def _cmd_stage(args: argparse.Namespace) -> int:
    import importlib

    from components.runtime.stage_server import STAGE_MODULES

    module = importlib.import_module(f"components.{STAGE_MODULES[args.name]}")
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


def _param_overrides(assignments: list[str]) -> dict[str, object]:
    """`--param key=value` (repeatable) as deployment parameters {"key": value}; values parsed as YAML."""
    import yaml

    out: dict[str, object] = {}
    for item in assignments:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"--param {item}: expected KEY=VALUE, e.g. grpo.kl_beta=0.1")
        out[key.strip()] = yaml.safe_load(value)
    return out


def _validated(root: Path, overrides: dict[str, object]):
    """params.yaml with the deployment overrides applied, validated (nothing written)."""
    from pipelines.flow import override_list
    from pipelines.params_io import merged_config

    return merged_config(root / "params.yaml", [], override_list(overrides))


def _cmd_serve(args: argparse.Namespace) -> int:
    from components.config import ConfigError
    from pipelines.operations import serve

    root = Path(args.root).resolve()
    try:
        overrides = _param_overrides(args.param)
        _validated(root, overrides)
    except (ConfigError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    serve(root, args.cron, args.interval, overrides, name=args.name, limit=args.limit)
    return 0


def _cmd_deploy(args: argparse.Namespace) -> int:
    import json

    from components.config import ConfigError
    from pipelines.operations import deploy

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


def _cmd_setup(args: argparse.Namespace) -> int:
    from components.config import load_config
    from pipelines.operations import setup

    limit = setup(load_config(Path(args.root).resolve() / "params.yaml"))
    print(f"concurrency limit for tag 'gpu': {limit} task run(s) at once")
    return 0


def _cmd_data_update(args: argparse.Namespace) -> int:
    from components.config import ConfigError
    from pipelines.operations import update_data

    try:
        info = update_data(Path(args.root).resolve(), Path(args.path), args.split, emit=not args.no_emit)
    except (ConfigError, ValueError, RuntimeError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"{info['path']} updated (md5 {info['md5']}), recorded with DVC"
          + ("" if args.no_emit else "; event grpo.dataset.updated emitted"))
    return 0


def _registry_client(root: str):
    from components.tracking.runs import client

    os.environ.setdefault("MLFLOW_TRACKING_URI", f"sqlite:///{Path(root).resolve() / 'mlflow.db'}")
    return client()


def _cmd_promote(args: argparse.Namespace) -> int:
    from components.locks import REGISTRY_LOCK, file_lock
    from components.tracking.registry import RegistryRefused, promote, rollback

    try:
        with file_lock(Path(args.root).resolve() / REGISTRY_LOCK, "a registry change in this repository", wait_s=60):
            client = _registry_client(args.root)
            if args.command == "promote":
                record = promote(client, args.name, args.version, args.reason or "manual promotion")
            else:
                record = rollback(client, args.name, args.reason or "manual rollback")
    except RegistryRefused as err:
        print(f"refused: {err}", file=sys.stderr)
        return 2
    print(f"{args.name}: champion moved from v{record['from']} to v{record['to']} by {record['who']} at "
          f"{record['when']} ({record['why']})")
    return 0


def _cmd_compare(args: argparse.Namespace) -> int:
    from components.config import load_config
    from components.tracking.registry import RegistryRefused, compare_table, pipeline_runs

    client = _registry_client(args.root)
    experiment = args.experiment or load_config(Path(args.root).resolve() / "params.yaml").tracking.experiment
    try:
        print(compare_table(pipeline_runs(client, experiment, args.run_ids, args.last)))
    except RegistryRefused as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
def _cmd_evaluate_many(args: argparse.Namespace) -> int:
    import json

    # Prefect's temporary API must answer within its start-up timeout (20 s by default; read when Prefect is
    # imported): on a loaded 2-core machine it took longer, and the command failed before evaluating anything.
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")
    from components.config import ConfigError
    from components.data.model_source import ModelLoadError
    from components.data.records import DataError
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
    run.set_defaults(func=_cmd_run)
    from components.runtime.stage_server import STAGE_MODULES  # standard library only: start-up stays fast

    stage = sub.add_parser("stage", help="run one stage directly, outside Prefect and DVC")
    stage.add_argument("name", choices=list(STAGE_MODULES))
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
    serve = sub.add_parser("serve", help="serve the pipeline as a Prefect deployment: schedule + data-update trigger")
    deploy = sub.add_parser("deploy", help="register the deployment on a Prefect work pool")
    for p in (serve, deploy):
        p.add_argument("--root", default=".", help="repository root")
        p.add_argument("--cron", help="cron schedule (default: operations.cron in params.yaml)")
        p.add_argument("--name", help="deployment name (default: operations.deployment)")
        p.add_argument("--param", action="append", default=[], metavar="KEY=VALUE",
                       help="deployment parameter overriding a params key, e.g. grpo.kl_beta=0.1; repeatable")
    serve.add_argument("--interval", type=float, metavar="SECONDS", help="run every SECONDS instead of a cron")
    serve.add_argument("--limit", type=int, help="most runs this process executes at once")
    serve.set_defaults(func=_cmd_serve)
    deploy.add_argument("--pool", default="grpo-process", help="work pool (created as --pool-type if missing)")
    deploy.add_argument("--pool-type", default="process",
                        help="type of a pool created here: process, docker, kubernetes")
    deploy.add_argument("--job-variables", help='JSON job variables, e.g. \'{"image": "my/grpo:1"}\'')
    deploy.set_defaults(func=_cmd_deploy)
    setup = sub.add_parser("setup", help="create the Prefect `gpu` concurrency limit (operations.gpu_concurrency)")
    setup.add_argument("--root", default=".", help="repository root")
    setup.set_defaults(func=_cmd_setup)
    data = sub.add_parser("data", help="dataset operations")
    data_sub = data.add_subparsers(dest="data_command", required=True)
    update = data_sub.add_parser("update", help="copy a new dataset in, record it with DVC, emit grpo.dataset.updated")
    update.add_argument("path", help="the new dataset file")
    update.add_argument("--split", default="train", choices=["train", "heldout", "sft"])
    update.add_argument("--root", default=".", help="repository root")
    update.add_argument("--no-emit", action="store_true", help="do not emit the event")
    update.set_defaults(func=_cmd_data_update)
    promote = sub.add_parser("promote", help="move the champion alias to VERSION (refused if not comparable)")
    promote.add_argument("name")
    promote.add_argument("version")
    rollback = sub.add_parser("rollback", help="give the champion alias back to the previous champion")
    rollback.add_argument("name")
    for p in (promote, rollback):
        p.add_argument("--reason", help="why (recorded with who and when)")
        p.add_argument("--root", default=".", help="repository root (registry lock, default store)")
        p.set_defaults(func=_cmd_promote)
    compare = sub.add_parser("compare", help="table of pipeline runs: differing params, rewards, data, durations")
    compare.add_argument("run_ids", nargs="*", help="MLflow run ids of pipeline runs (default: the --last N)")
    compare.add_argument("--last", type=int, default=5, help="the N newest pipeline runs")
    compare.add_argument("--experiment", help="experiment (default: tracking.experiment)")
    compare.add_argument("--root", default=".", help="repository root")
    compare.set_defaults(func=_cmd_compare)
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
    from components.quiet import quiet_libraries

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
    code = args.func(args)
    if argv is None and args.func is _cmd_run and not args.dry_run:
        # The command line's own run: everything is written and the servers are stopped; with Prefect's
        # logs and events drained, tearing down the interpreter's modules (Prefect, MLflow, DVC,
        # pandas) would only add 1-2 s.
        from pipelines.warmup import detach_api_logging

        detach_api_logging()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


if __name__ == "__main__":
    sys.exit(main())
