"""`grpo-pipeline run` once the servers are starting: the config checks, params.yaml, the Prefect flow and
its report, and the working copy put back as it was when the run fails."""

from __future__ import annotations

import argparse
import os
import sys
import time
import traceback
from pathlib import Path

from components.config import ConfigError, config_warnings
from components.data.model_source import ModelLoadError, check_model_source
from components.data.records import DataError
from components.errors import StageFailed
from components.runtime.stage_server import imports_without_collection
from pipelines import interrupts, warmup
from pipelines.commands.run_report import band_report, report_overhead
from pipelines.leftovers import recover_leftovers
from pipelines.params_io import (
    check_dvc_reads,
    mark_finished,
    merged_config,
    prepare_params,
    preset_path,
    user_params,
)
from pipelines.safekeeping import WorkingCopySnapshot


def check_and_run(args: argparse.Namespace, root: Path, api) -> int:
    try:
        overlays = ([preset_path(args.preset)] if args.preset else []) + [Path(p) for p in args.params]
        # the user's own settings plus this run's overrides (an earlier run's overrides are not carried over)
        with user_params(root) as own:
            cfg = merged_config(own, overlays, args.overrides)
            check_dvc_reads(own)  # the file DVC will read: refused in one line when DVC cannot read it
        for warning in config_warnings(cfg):
            print(f"warning: {warning}", file=sys.stderr)
        if cfg.model.name_or_path:  # fail before any stage starts, with the offline hint for hub ids
            os.chdir(root)
            check_model_source(cfg.model.name_or_path, cfg.model.allow_download, cfg.model.gguf_file)
        if args.dry_run:
            from pipelines.dry_run import dry_run  # imports torch, which only --dry-run needs in this process

            os.chdir(root)
            dry_run(cfg)
            return 0
        for line in recover_leftovers(root):  # DVC's files a killed run left, before DVC reads them
            print(line)
        snapshot = WorkingCopySnapshot.take(root)
        described = " ".join(([f"--preset {args.preset}"] if args.preset else [])
                             + [f"--params {p}" for p in args.params] + [f"--set {o}" for o in args.overrides])
        # the user's own params.yaml first when an earlier run's one-off overrides are still in it (killed or not);
        # taken after the snapshot, so that a failure of this run leaves params.yaml as it found it
        for line in prepare_params(root, overlays, args.overrides, args.persist, described):
            print(line)
    except (ConfigError, ValueError, DataError, ModelLoadError, StageFailed) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    try:
        code, failure = _run_flow(args, root, cfg, api)
    except BaseException:
        _undo(snapshot, None)
        raise
    if code == 0:
        mark_finished(root)
        snapshot.discard()
    elif getattr(failure, "keep_finished", False):
        mark_finished(root)
        _keep_finished(snapshot, list(getattr(failure, "finished", [])))
    else:
        _undo(snapshot, Path(os.environ.get("GRPO_RUN_LOG", root / "logs" / "run.log")))
    return code


def _keep_finished(snapshot, finished: list[str]) -> None:
    """A failure that says nothing against the stages that finished: what they produced stays (their outputs,
    dvc.lock, this run's params), the other stages' outputs are put back (pipelines/safekeeping.py)."""
    try:
        snapshot.restore(finished=set(finished))
    except Exception as err:  # noqa: BLE001 - the run's own failure stays the report
        print(f"warning: could not put back the unfinished stages' outputs ({err})", file=sys.stderr)
    else:
        print(f"kept what the finished stages produced ({', '.join(finished) or 'none'}: their outputs, dvc.lock, "
              "params.yaml with this run's settings): rerun the same command; it runs only what did not finish",
              file=sys.stderr)
    snapshot.discard()


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


def _run_flow(args: argparse.Namespace, root: Path, cfg, api) -> tuple[int, BaseException | None]:
    # Prefect, DVC and the flow are imported here, in this order, with the collector off: the temporary
    # API is forked after Prefect's import, and the tracking store starts while DVC and the flow import.
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
    from prefect.exceptions import CancelledRun  # Prefect is imported by now (above)

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
        return interrupts.exit_code(), None
    except Exception as err:  # noqa: BLE001 - the stage's own message is the report
        with log_file.open("a", encoding="utf-8") as fh:
            fh.write(traceback.format_exc() + "\n" + getattr(err, "detail", "") + "\n")
        if getattr(args, "verbose", False):
            traceback.print_exc()
        print(f"\nerror: {err}\n(full log with the traceback: {log_file})", file=sys.stderr)
        return 1, err
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
        print("record the run in git: git add -f dvc.lock params.yaml metrics plots/*.png && git commit "
              "(DVC keeps the data, models and plots/grpo_steps.csv: `dvc push` sends them)")
    report_overhead(result)
    print("=" * 72)
    return 0, None


def attach_run_log(root: Path) -> Path:
    """Where this run's full log goes (logs/run-<time>.log): the flow attaches it once Prefect has set
    up its logging (pipelines/flow.py `quiet_stage_errors`), so tracebacks land there, not on screen."""
    from pipelines.flow import RUN_LOG_ENV  # imports Prefect: the caller has imported it by now

    path = root / "logs" / time.strftime("run-%Y%m%d-%H%M%S.log")
    path.parent.mkdir(exist_ok=True)
    path.touch()
    os.environ[RUN_LOG_ENV] = str(path)
    return path
