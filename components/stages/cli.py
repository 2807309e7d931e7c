"""Shared command-line entry for the stage modules (`python -m components.stages.<stage>`)."""

from __future__ import annotations

import argparse
import gc
import importlib
import json
import os
import sys
import time
from collections.abc import Callable

from components.config import ConfigError, PipelineConfig, load_config
from components.errors import StageFailed
from components.interruptions import StageInterrupted, progress, stop_on_signals
from components.quiet import quiet_libraries
from components.run_marker import NoMarker, RunMarker, killed_run_text, marker_path
from components.tracking.outbox import tracking_outage
from components.user_code import UserCodeError

STAGE_TIMINGS_ENV = "GRPO_STAGE_TIMINGS"
# Imported before a stage's clock starts, so its recorded compute time excludes library start-up.
HEAVY_IMPORTS = ("torch", "transformers", "transformers.models.llama.modeling_llama", "mlflow")
# Stages that use less: `prepare` reads and writes JSONL and logs to MLflow (no torch); `validate`
# runs Great Expectations and needs only the tokenizer and config (transformers' config imports torch).
TOKENIZER_IMPORTS = ("transformers", "transformers.models.auto.tokenization_auto",
                     "transformers.models.auto.configuration_auto")
# `model` builds the tiny default with the Llama modelling code, without GX.
STAGE_IMPORTS = {"prepare": ("mlflow",),
                 "model": ("mlflow", "torch", *TOKENIZER_IMPORTS, "transformers.models.llama.modeling_llama"),
                 "validate": ("mlflow", "torch", *TOKENIZER_IMPORTS, "great_expectations"),
                 # ... and `grpo` draws its figures at its end (pyplot)
                 "grpo": (*HEAVY_IMPORTS, "matplotlib.pyplot")}


# Set by the Prefect flow: a refused stage writes its message here instead of printing it, and the
# flow reports it once, at the end (run alone or under `dvc repro`, the stage prints it itself).
ERROR_FILE_ENV = "GRPO_STAGE_ERROR_FILE"


INTERRUPT_PREFIX = "interrupted during "


def report_error(message: str, outage: dict[str, str] | None = None) -> None:
    """The stage's one report: printed, or under the flow written to its report file as JSON, `outage` (which of the
    pipeline's own servers did not answer: {"server", "address"}) beside the message, the field the flow's retry
    rule reads (pipelines/retries.py); the words of the message are never read for it."""
    target = os.environ.get(ERROR_FILE_ENV)
    if target:
        with open(target, "w", encoding="utf-8") as fh:
            fh.write(json.dumps({"message": message, "outage": outage}))
    else:
        print(f"error: {message}", file=sys.stderr)


def read_report(path: str) -> tuple[str, dict[str, str] | None]:
    """(the message, the outage field) of a stage's report file; a plain-text report (the stage's launcher writes
    one: components/runtime/launch.py) has no outage field."""
    try:
        text = open(path, encoding="utf-8").read().strip()
    except OSError:
        return "", None
    try:
        report = json.loads(text) if text.startswith("{") else None
    except ValueError:
        report = None
    if isinstance(report, dict) and isinstance(report.get("message"), str):
        return report["message"], report.get("outage") or None
    return text, None


def stage_main(description: str, run: Callable[[PipelineConfig], object], argv: list[str] | None = None) -> int:
    """Parse `--params`/`--set`, run the stage, and turn known failures into one clear line + exit 1."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--params", default="params.yaml", help="params file (default: params.yaml)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override one params key, e.g. --set grpo.kl_beta=0.1")
    args = parser.parse_args(argv)
    from components.data.checkpoints import CheckpointWriteError
    from components.data.model_source import ModelLoadError
    from components.data.records import DataError
    from components.engine.rewards.rewards import check_rewards

    stage = _stage_name(run)
    quiet_libraries()
    stop_on_signals()
    marker = _stage_marker(stage)
    try:
        cfg = load_config(args.params, args.overrides)
        check_rewards(cfg.grpo.rewards)
        if cfg.grpo.tools or cfg.grpo.environment:  # imports the user's code (and torch): only when there is some
            from components.engine.generation.environments.spec import check_episodes

            check_episodes(cfg.grpo)
        entered = time.time()
        _warm_up(cfg, stage)
        started, started_at = time.perf_counter(), time.time()
        run(cfg)
        _record_compute(stage, time.perf_counter() - started,
                        entered=entered, started_at=started_at)
    except (ConfigError, DataError, ModelLoadError, StageFailed, CheckpointWriteError) as err:
        report_error(str(err))
        return 1
    except UserCodeError as err:  # the user's function failed (components/user_code.py): named, one line
        report_error(f"{stage}: {err}; nothing of this stage was kept: fix it and rerun")
        return 1
    except Exception as err:
        if not tracking_outage(err):  # known by where it was raised: MLflow's client, never the user's code
            raise
        from components.tracking.runs import tracking_uri

        needs = "registering a model needs it" if stage == "register" else "this stage cannot go on without it"
        report_error(f"the MLflow tracking server at {tracking_uri()} did not answer after bounded retries "
                     f"({type(err).__name__}) and {needs}; everything on disk is kept (checkpoints, finished stages' "
                     "outputs, queued tracking records): rerun when it is back",
                     outage={"server": "MLflow tracking server", "address": tracking_uri()})
        return 1
    except StageInterrupted as stop:
        where = f" {progress()}" if progress() else ""
        report_error(f"{INTERRUPT_PREFIX}{'model' if stage == 'base_model' else stage}{where} ({stop}); "
                     "rerun to resume")
        return 128 + stop.signum
    finally:
        marker.clear()
    return 0


def _stage_marker(stage: str) -> RunMarker:
    """The stage's note while it runs (components/run_marker.py), on the main process only (rank 0); first, what
    the note of an earlier run that died without a word says about it."""
    if int(os.environ.get("RANK", "0")) != 0:
        return NoMarker()
    marker = RunMarker(marker_path("model" if stage == "base_model" else stage))
    if note := marker.left_by_a_killed_run():
        print(killed_run_text(stage, note), flush=True)
    marker.write(stage=stage)
    return marker


def _stage_name(run: Callable) -> str:
    """`prepare` for components.stages.prepare, also when it runs as `python -m` (its module is then `__main__`)."""
    spec = getattr(run, "__globals__", {}).get("__spec__")
    return (spec.name if spec is not None else run.__module__).rsplit(".", 1)[-1]


def _warm_up(cfg: PipelineConfig, stage: str) -> None:
    """Library imports and the tracking store's first connection: start-up, not the stage's own work. A rank other
    than 0 of a distributed stage tracks nothing (`tracking.runs.tracking_run`), so it neither imports MLflow here nor
    connects to the store."""
    tracks = int(os.environ.get("RANK", "0")) == 0
    for name in STAGE_IMPORTS.get(stage, HEAVY_IMPORTS):
        if tracks or name != "mlflow":
            importlib.import_module(name)
    if not tracks:
        return
    from components.tracking.runs import experiment_id, note_unreachable

    try:
        experiment_id(cfg.tracking.experiment)
    except Exception as err:  # an outage is the stage's to handle (it logs offline)
        if not tracking_outage(err):
            raise
        note_unreachable()


def _record_compute(stage: str, seconds: float, entered: float, started_at: float) -> None:
    """Append the stage's compute time where the pipeline asked for it (its overhead report).

    `entered`, `started_at` and `ended_at` are wall-clock stamps (entry, end of warm-up, end of work),
    so the report can say where the rest of the run's time went. `gc_frozen` counts the objects the
    stage inherited frozen from the warm stage server (0 when it ran on its own), which its garbage
    collections never walk (components/runtime/stage_server.py).
    """
    path = os.environ.get(STAGE_TIMINGS_ENV)
    if path:
        server = sys.modules.get("components.runtime.stage_server")
        frozen = getattr(server, "frozen_objects", 0)
        with open(path, "a") as fh:
            fh.write(json.dumps({"stage": stage, "compute_seconds": round(seconds, 3), "entered": round(entered, 3),
                                 "started_at": round(started_at, 3), "ended_at": round(time.time(), 3),
                                 "gc_frozen": frozen, "gc_enabled": gc.isenabled()}) + "\n")
