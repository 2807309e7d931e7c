"""The Prefect flow: one task per DVC stage, each reproduced by DVC (`dvc repro --single-item`).

Prefect decides *when* (schedules, triggers, retries, the `gpu` concurrency tag); DVC decides
*whether* a stage must run (its deps and params changed) and records dvc.lock; the stages never
know which of them called. One MLflow parent run per flow run; stages nest under it through
GRPO_PARENT_RUN_ID.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from prefect import flow, get_run_logger, task
from prefect.artifacts import create_markdown_artifact

from components.config import load_config, to_flat_dict
from components.tracking.runs import PARENT_RUN_ENV
from pipelines import interrupts

STAGES = ("prepare", "model", "validate", "sft", "grpo", "evaluate", "register")
GPU_STAGES = {"sft", "grpo", "evaluate"}
GPU_TAG = "gpu"


class StageError(RuntimeError):
    """A stage exited non-zero. The message is its one report (a refused input: the rule, the file,
    the row or key); `detail` keeps its last lines of output for the log and the retry rule.

    `keep_finished`: what the finished stages produced stays (dvc.lock, their outputs, the run's params), as
    `dvc repro` leaves it after a later stage failed: a failure that says nothing against them (registering
    could not reach the tracking server; DVC could not store an output in its cache). `finished`: those stages.
    `outage`: {"server", "address"} when the stage's own report says the pipeline's connection to that server
    failed (components/stages/cli.py `report_error`): the only failure the retry rule retries."""

    def __init__(self, message: str, detail: str = "", keep_finished: bool = False,
                 outage: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.detail = detail
        self.keep_finished = keep_finished
        self.outage = outage
        self.finished: list[str] = []


class StageInterruptedError(StageError):
    """The stage stopped on SIGINT/SIGTERM and said where (`interrupted during grpo at step N; ...`)."""


class OneLineStageErrors(logging.Filter):
    """On the console, a failed stage is one line in Prefect's logs, not a traceback: the report itself
    is printed once, by the CLI, and the full traceback goes to the run's log file."""

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        if str(record.msg).startswith("Task run failed with %s: %r - Retry"):
            return False  # a retry of an outage: pipelines/retries.py says it in one line of its own
        text = record.getMessage()
        if isinstance(error, StageInterruptedError) or "StageInterruptedError" in text:
            # The flow run's Cancelled line and the CLI's last line carry the message.
            record.msg = text.split("StageInterruptedError")[0].split("(")[0].rstrip(" :('\"") + " (interrupted)"
            record.args, record.exc_info, record.exc_text = (), None, None
        elif isinstance(error, StageError) or "StageError" in text:
            first = (": " + str(error).splitlines()[0]) if isinstance(error, StageError) \
                else " (a stage failed; its report is printed at the end)"
            record.msg = text.split("StageError")[0].rstrip(" :('\"") + first
            record.args, record.exc_info, record.exc_text = (), None, None
        return True


RUN_LOG_ENV = "GRPO_RUN_LOG"  # set by `grpo-pipeline run`: the file that gets the full log, tracebacks included


def quiet_stage_errors() -> None:
    """Install `OneLineStageErrors` on the console handlers Prefect logs through, and the run's log file
    (`GRPO_RUN_LOG`) on the root logger; idempotent."""
    root = logging.getLogger()
    for logger in (root, logging.getLogger("prefect")):
        for handler in logger.handlers:
            if isinstance(handler, logging.StreamHandler) and not isinstance(handler, logging.FileHandler) \
                    and not any(isinstance(f, OneLineStageErrors) for f in handler.filters):
                handler.addFilter(OneLineStageErrors())
    path = os.environ.get(RUN_LOG_ENV)
    if path and not any(getattr(h, "baseFilename", None) == str(Path(path).resolve()) for h in root.handlers):
        handler = logging.FileHandler(path, encoding="utf-8")
        handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s %(message)s"))
        root.addHandler(handler)


def stage_env(parent_run_id: str | None) -> dict[str, str]:
    """The environment a stage runs in: this interpreter's bin first on PATH, the parent run id."""
    env = dict(os.environ)
    env["PATH"] = str(Path(sys.executable).parent) + os.pathsep + env.get("PATH", "")
    if parent_run_id:
        env[PARENT_RUN_ENV] = parent_run_id
    return env


@task(name="stage", retries=0)
def run_stage(stage: str, root: str, parent_run_id: str | None) -> dict[str, Any]:
    """`dvc repro --single-item STAGE` through DVC's Python API; DVC skips the stage when nothing changed.

    DVC is imported once per flow, not once per stage; it still hashes, runs the dvc.yaml command and writes
    dvc.lock as the CLI does (the same data, without the round trip: pipelines/dvc_lockfile.py; each YAML text
    parsed once: pipelines/dvc_yaml_cache.py). The stage's output is relayed as it comes, its last lines kept."""
    import tempfile

    from dvc.exceptions import DvcException
    from dvc.repo import Repo

    from components.stages.cli import ERROR_FILE_ENV, INTERRUPT_PREFIX, read_report
    from pipelines.dvc_lockfile import lock_files_without_round_trip
    from pipelines.dvc_writes import (
        cache_write_text,
        failed_cache_writes,
        killed_by,
        remember_unstored,
        store_outputs_missing_from_cache,
    )
    from pipelines.dvc_yaml_cache import yaml_parsed_once

    print_dvc_lines_once()
    logger = get_run_logger()
    started = time.perf_counter()
    previous_env, previous_cwd = dict(os.environ), os.getcwd()
    handle, report = tempfile.mkstemp(prefix=f"grpo-{stage}-error-", suffix=".txt")
    os.close(handle)
    os.environ.update(stage_env(parent_run_id))
    os.environ[ERROR_FILE_ENV] = report
    os.chdir(root)  # as `dvc repro` run from the repository (a served flow starts elsewhere)
    try:
        with captured_output() as lines, Repo(root) as repo, failed_cache_writes() as refused_writes, \
                lock_files_without_round_trip(), yaml_parsed_once():
            repo.scm_context.quiet = True  # its "git add dvc.lock" hint: once per run, by the CLI
            stored = store_outputs_missing_from_cache(repo, stage, root)
            if stored:
                print(f"{stage}: stored {', '.join(stored)} in the DVC cache, which a failed write had left without "
                      "them; nothing to run again for them", flush=True)
            ran = repo.reproduce(stage, single_item=True)
            cache_dir = repo.cache.local_cache_dir
        if refused_writes:
            remember_unstored(root, stage)
            raise StageError(cache_write_text(stage, refused_writes, root, cache_dir), keep_finished=True) from None
    except DvcException as err:
        tail = "\n".join(line for line in lines[-40:] if line.strip())
        refused, outage = read_report(report)
        if refused.startswith(INTERRUPT_PREFIX):
            raise StageInterruptedError(refused, detail=tail) from None
        if refused:  # the stage's own report (or its launcher's): the whole message, once
            said = refused if refused.startswith(f"{stage}: ") else f"{stage}: {refused}"
            raise StageError(said, detail=tail, outage=outage) from None
        cause = f": {err.__cause__}" if err.__cause__ else ""
        signum = killed_by(err)
        if signum:  # named by its signal (DVC's "exited with -9"; a shell's 137)
            raise StageError(f"stage '{stage}' was killed by {signal.Signals(signum).name}; its last lines:\n{tail}",
                             detail=tail) from None
        raise StageError(f"stage '{stage}' failed ({err}{cause}); its last lines:\n{tail}", detail=tail) from None
    finally:
        os.chdir(previous_cwd)
        os.environ.clear()
        os.environ.update(previous_env)
        Path(report).unlink(missing_ok=True)
    seconds = time.perf_counter() - started
    skipped = not ran
    logger.info("stage %s %s in %.1fs", stage, "up to date" if skipped else "ran", seconds)
    return {"stage": stage, "skipped": skipped, "seconds": round(seconds, 2)}


def print_dvc_lines_once() -> None:
    """DVC prints through handlers of its own; passed on to the root logger as well, where Prefect's
    console handler sits, every DVC line ("Running stage ...") came out twice."""
    import logging

    logging.getLogger("dvc").propagate = False


@contextlib.contextmanager
def captured_output(keep: int = 200) -> Iterator[list[str]]:
    """Relay everything written to fds 1 and 2 (by this process or its children) and keep the last lines."""
    import collections
    import threading

    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    read_end, write_end = os.pipe()
    tail: collections.deque[str] = collections.deque(maxlen=keep)
    lines: list[str] = []

    def relay() -> None:
        with os.fdopen(read_end, "rb") as pipe:
            for raw in pipe:
                os.write(saved[0], raw)
                tail.append(raw.decode(errors="replace").rstrip("\n"))

    reader = threading.Thread(target=relay, daemon=True)
    reader.start()
    os.dup2(write_end, 1)
    os.dup2(write_end, 2)
    os.close(write_end)
    try:
        yield lines
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        reader.join(timeout=10)
        for fd in saved:
            os.close(fd)
        lines.extend(tail)


def tag_limit_exists(tag: str) -> bool:
    """Whether the Prefect API has a concurrency limit on `tag` (`grpo-pipeline setup` creates `gpu`'s).

    GPU stages carry the tag only where the limit exists. A tagged task asks the API for a slot
    even when there is no limit, and on a SQLite-backed API that request races the server's own
    event writes: it is answered 503 now and then, and Prefect's client retries it seconds later, a
    wait before each of sft, grpo and evaluate for a limit that was not there.
    """
    from prefect.client.orchestration import get_client
    from prefect.exceptions import ObjectNotFound

    with get_client(sync_client=True) as prefect_client:
        try:
            prefect_client.read_concurrency_limit_by_tag(tag)
        except ObjectNotFound:
            return False
    return True


class ParentRun:
    """The flow's MLflow parent run; each call is a job in the warm stage server (components/runtime/parent_run.py).

    The server forks it from an interpreter that has MLflow imported, so this process never imports
    MLflow. Without a server (or when it refuses), the job runs here instead.
    """

    def __init__(self, run_id: str, experiment_id: str) -> None:
        self.run_id, self.experiment_id = run_id, experiment_id

    @classmethod
    def start(cls, experiment: str, params: dict[str, Any], run_name: str = "pipeline") -> ParentRun:
        from components.runtime.parent_run import run_job

        answer = run_job({"action": "start", "experiment": experiment, "params": params,
                          "tags": {"grpo.stage": "pipeline"}, "run_name": run_name})
        return cls(answer["run_id"], answer["experiment_id"])

    def update(self, metrics: dict[str, float] | None = None, tags: dict[str, Any] | None = None,
               status: str | None = None) -> None:
        from components.runtime.parent_run import run_job

        run_job({"action": "update", "run_id": self.run_id, "metrics": metrics or {},
                 "tags": {k: str(v) for k, v in (tags or {}).items()}, "status": status})


def parent_run_name(cfg, now: float | None = None) -> str:
    """What ran, readable in the MLflow run list: `grpo-addition · dapo β0.04 · 2026-11-23 14:02`."""
    g = cfg.grpo
    algorithm = "reinforce" if g.algorithm == "reinforce" else g.loss_type
    stamp = time.strftime("%Y-%m-%d %H:%M", time.localtime(now))
    return f"{cfg.register.model_name} · {algorithm} β{g.kl_beta:g}{' LoRA' if g.lora.enabled else ''} · {stamp}"


def mlflow_links(tracking: str, experiment_id: str, run_id: str, model_name: str, version: str) -> dict[str, str]:
    """UI addresses of the run and the model version (a local store: as served by `mlflow ui` on :5000)."""
    base = tracking.rstrip("/") if tracking.startswith(("http://", "https://")) else "http://127.0.0.1:5000"
    return {"run": f"{base}/#/experiments/{experiment_id}/runs/{run_id}",
            "model_version": f"{base}/#/models/{model_name}/versions/{version}",
            "local": "" if base != "http://127.0.0.1:5000" else
            f" (start the UI with `mlflow ui --backend-store-uri {tracking}`)"}


def report_markdown(evaluation: dict[str, Any], registration: dict[str, Any], stages: list[dict[str, Any]],
                    parent_run_id: str, tracking: str, experiment_id: str = "0") -> str:
    """Before/after table, the promotion decision, and links to the MLflow run and model version."""
    links = mlflow_links(tracking, experiment_id, parent_run_id, registration["model_name"], registration["version"])
    imp = evaluation["improvement"]
    rows = "\n".join(f"| {s['stage']} | {'up to date' if s['skipped'] else 'ran'} | {s['seconds']:.1f} |"
                     for s in stages)
    return (
        "# GRPO pipeline run\n\n"
        "| model | held-out mean reward |\n|---|---|\n"
        f"| baseline (before GRPO) | {evaluation['baseline']['mean_reward']:.4f} |\n"
        f"| candidate (after GRPO) | {evaluation['candidate']['mean_reward']:.4f} |\n\n"
        f"Improvement {imp['mean']:+.4f} (95% CI {imp['ci95_low']:+.4f} .. {imp['ci95_high']:+.4f}), "
        f"n = {evaluation['n']}.\n\n"
        f"**Decision:** version {registration['version']} of `{registration['model_name']}` is "
        f"**{'champion' if registration['promoted'] else 'challenger'}**: {registration['reason']}.\n\n"
        f"- Model version: [{registration['model_uri']}]({links['model_version']}) "
        f"(champion: `{registration['champion_uri']}`)\n"
        f"- MLflow run: [{parent_run_id}]({links['run']}) in `{tracking}`{links['local']}\n\n"
        "| stage | status | seconds |\n|---|---|---|\n" + rows + "\n"
    )


def override_list(overrides: dict[str, Any] | None) -> list[str]:
    """Deployment parameters `{"grpo.kl_beta": 0.1}` as `key=value` assignments (values YAML-quoted)."""
    return [f"{key}={json.dumps(value)}" for key, value in (overrides or {}).items()]


@flow(name="grpo-pipeline", log_prints=True)
def grpo_pipeline(root: str = ".", overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    """prepare -> model -> validate -> sft -> grpo -> evaluate -> register, on params.yaml in `root`.

    `overrides` (`{"grpo.kl_beta": 0.1}`) are written into params.yaml first, like `run --set`, so a
    deployment's parameters override params keys and `dvc repro` still reproduces the run.
    One run per repository at a time: `grpo-pipeline run` refuses a second one; a served or deployed
    run waits up to `operations.lock_wait_s` for the running one (schedule and trigger may coincide).
    """
    from components.locks import LOCK_HELD_ENV, PIPELINE_LOCK, file_lock

    root_path = Path(root).resolve()
    try:
        with interrupts.inside_flow():
            if os.environ.get(LOCK_HELD_ENV) == str(os.getpid()):
                return _run_stages(root_path, overrides)
            wait_s = load_config(root_path / "params.yaml").operations.lock_wait_s
            with file_lock(root_path / PIPELINE_LOCK, "a pipeline run in this repository", wait_s=wait_s):
                from pipelines.leftovers import recover_after_a_kill

                recover_after_a_kill(root_path)
                return _run_stages(root_path, overrides)
    except StageInterruptedError as stop:  # stopped on purpose: Cancelled, not Failed
        from prefect.states import Cancelled

        return Cancelled(message=str(stop))


def _run_stages(root_path: Path, overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    """The stages in order, each in the warm stage server (components/runtime/stage_server.py) when one runs."""
    from components.runtime.stage_server import SERVER_ENV, start_server, stop_server

    own_server = None
    if not os.environ.get(SERVER_ENV):  # the CLI starts one early; deployments and tests get one here
        own_server = start_server(str(root_path))
        os.environ[SERVER_ENV] = own_server[1]
    try:
        return _run_stages_with_server(root_path, overrides)
    finally:
        if own_server is not None:
            os.environ.pop(SERVER_ENV, None)
            stop_server(*own_server)


def read_compute_times(path: Path) -> list[dict[str, Any]]:
    """The compute seconds each stage that ran recorded (components/stages/cli.py)."""
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _parent_run_record(root_path: Path, evaluation: dict[str, Any],
                       registration: dict[str, Any]) -> tuple[dict[str, float], dict[str, Any]]:
    """What a finished run's parent MLflow run records: the rewards before and after (and against the champion),
    the data's hashes, the model version and the promotion decision."""
    from components.data.records import SPLITS, file_md5, split_path

    metrics = {"baseline_mean_reward": evaluation["baseline"]["mean_reward"],
               "candidate_mean_reward": evaluation["candidate"]["mean_reward"],
               "improvement_mean": evaluation["improvement"]["mean"],
               "improvement_ci95_low": evaluation["improvement"]["ci95_low"],
               "improvement_ci95_high": evaluation["improvement"]["ci95_high"]}
    if registration.get("vs_champion"):  # beside the comparison with its start: the one with the champion
        metrics.update({f"vs_champion_{k}": registration["vs_champion"][k] for k in ("mean", "ci95_low", "ci95_high")})
    tags = {**{f"data.{split}.md5": file_md5(split_path(root_path / "data" / "prepared", split)) for split in SPLITS},
            "model_version": registration["version"], "model_name": registration["model_name"],
            "promotion.decision": "champion" if registration["promoted"] else "challenger",
            "promotion.champion_version": str(registration.get("champion_version") or "none")}
    return metrics, tags


def _run_stages_with_server(root_path: Path, overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    import tempfile

    from components.stages.cli import STAGE_TIMINGS_ENV
    from components.tracking.runs import tracking_uri
    from pipelines.params_io import apply_to_params
    from pipelines.retries import backoff_delays, retry_transient

    quiet_stage_errors()
    if overrides and apply_to_params(root_path / "params.yaml", [], override_list(overrides)):
        print(f"params.yaml updated with the deployment's overrides: {override_list(overrides)}")
    cfg = load_config(root_path / "params.yaml")
    ops = cfg.operations
    timings = Path(tempfile.mkstemp(prefix="grpo-stage-times-", suffix=".jsonl")[1])
    os.environ[STAGE_TIMINGS_ENV] = str(timings)
    os.environ.setdefault("MLFLOW_TRACKING_URI", tracking_uri(root_path))
    from pipelines.open_runs import OPEN_RUNS_FILE, OpenRuns

    open_runs = OpenRuns(root_path / OPEN_RUNS_FILE)
    open_runs.close_killed()
    parent = ParentRun.start(cfg.tracking.experiment, to_flat_dict(cfg), parent_run_name(cfg))
    open_runs.add(parent.run_id)
    stages: list[dict[str, Any]] = []
    status = "FAILED"
    gpu_tags = {GPU_TAG} if tag_limit_exists(GPU_TAG) else set()
    metrics: dict[str, float] = {}
    tags: dict[str, Any] = {}
    try:
        for stage in STAGES:
            if interrupts.requested():  # a signal between two stages: the next one never starts
                raise StageInterruptedError(f"interrupted before {stage} "
                                            f"({signal.Signals(interrupts.requested()).name}); rerun to resume")
            stage_tags = gpu_tags if stage in GPU_STAGES else set()
            task_ = run_stage.with_options(name=f"stage-{stage}", tags=stage_tags, retries=ops.stage_retries,
                                           retry_delay_seconds=backoff_delays(ops.retry_delay_s, ops.stage_retries),
                                           retry_condition_fn=retry_transient)
            try:
                stages.append(task_(stage, str(root_path), parent.run_id))
            except StageError as failed:
                if stage == "register" and not isinstance(failed, StageInterruptedError):
                    failed.keep_finished = True  # everything it registers is finished and stays for the rerun
                failed.finished = [s["stage"] for s in stages] + ([stage] if stage != "register" and
                                                                  failed.keep_finished else [])
                raise
        evaluation = json.loads((root_path / "metrics" / "eval.json").read_text())
        registration = json.loads((root_path / "metrics" / "register.json").read_text())
        metrics, tags = _parent_run_record(root_path, evaluation, registration)
        status = "FINISHED"
    except StageInterruptedError:
        status = "KILLED"
        raise
    finally:
        os.environ.pop(STAGE_TIMINGS_ENV, None)
        compute = read_compute_times(timings)
        timings.unlink(missing_ok=True)
        tags["stages.ran"] = ",".join(s["stage"] for s in stages if not s["skipped"]) or "none"
        try:  # one job: the outcome, and on success the rewards, data hashes and model version
            parent.update(metrics=metrics, tags=tags, status=status)
            open_runs.remove(parent.run_id)
        except Exception as err:
            if status == "FINISHED":
                raise
            print(f"(the MLflow parent run was not marked FAILED: {err})", file=sys.stderr)
    create_markdown_artifact(key="grpo-pipeline-report", description="Before/after and promotion decision",
                             markdown=report_markdown(evaluation, registration, stages, parent.run_id,
                                                      os.environ["MLFLOW_TRACKING_URI"], parent.experiment_id))
    return {"evaluation": evaluation, "registration": registration, "stages": stages,
            "parent_run_id": parent.run_id, "stage_compute": compute}
