"""Prefect operations: serve or deploy the pipeline, create the `gpu` limit, announce new data.

A repository's deployment runs on a schedule (cron from `operations.cron`, or a short interval)
and whenever a `grpo.dataset.updated` event names this repository as its resource, which
`grpo-pipeline data update` emits after copying the new file in and recording it with DVC.
"""

from __future__ import annotations

import datetime as dt
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

from components.config import PipelineConfig, load_config

RESOURCE_PREFIX = "grpo-pipeline.repository."
SPLIT_CHOICES = ("train", "heldout", "sft")


def resource_id(root: Path) -> str:
    """The event resource naming one repository: a deployment only reacts to its own repository's data."""
    return RESOURCE_PREFIX + str(root.resolve())


def build_deployment(root: Path, cfg: PipelineConfig, cron: str | None = None, interval_s: float | None = None,
                     overrides: dict[str, Any] | None = None, name: str | None = None,
                     work_pool: str | None = None, job_variables: dict[str, Any] | None = None):
    """The pipeline as a RunnerDeployment: schedule, event trigger, parameters (root + params overrides)."""
    from prefect.events import DeploymentEventTrigger
    from prefect.flows import EntrypointType
    from prefect.schedules import Cron, Interval

    from pipelines.flow import grpo_pipeline

    ops = cfg.operations
    schedules = []
    if interval_s:  # first run one interval from now, so a run started by an event is not raced at start-up
        anchor = dt.datetime.now(dt.UTC) + dt.timedelta(seconds=interval_s)
        schedules.append(Interval(interval_s, anchor_date=anchor))
    elif cron or ops.cron:
        schedules.append(Cron(cron or ops.cron, timezone=ops.timezone))
    trigger = DeploymentEventTrigger(name=f"{name or ops.deployment}: {ops.trigger_event}",
                                     expect={ops.trigger_event}, match={"prefect.resource.id": resource_id(root)})
    kwargs: dict[str, Any] = {}
    if work_pool:
        kwargs.update(work_pool_name=work_pool, job_variables=job_variables or {})
    return grpo_pipeline.to_deployment(
        name=name or ops.deployment, schedules=schedules, triggers=[trigger],
        parameters={"root": str(root.resolve()), "overrides": overrides or {}}, tags=["grpo-pipeline"],
        description=f"GRPO pipeline on {root.resolve()}", entrypoint_type=EntrypointType.MODULE_PATH, **kwargs)


def serve(root: Path, cron: str | None, interval_s: float | None, overrides: dict[str, Any],
          name: str | None = None, limit: int | None = None) -> None:
    """Serve the deployment from this process until interrupted (runs execute as subprocesses here)."""
    from prefect import serve as prefect_serve

    cfg = load_config(root / "params.yaml")
    deployment = build_deployment(root, cfg, cron, interval_s, overrides, name)
    prefect_serve(deployment, limit=limit)


def ensure_work_pool(pool: str, pool_type: str) -> None:
    from prefect import get_client
    from prefect.client.schemas.actions import WorkPoolCreate
    from prefect.exceptions import ObjectNotFound

    with get_client(sync_client=True) as client:
        try:
            client.read_work_pool(pool)
        except ObjectNotFound:
            client.create_work_pool(WorkPoolCreate(name=pool, type=pool_type))
            print(f"created work pool '{pool}' (type {pool_type})")


def deploy(root: Path, pool: str, pool_type: str, cron: str | None, overrides: dict[str, Any],
           job_variables: dict[str, Any], name: str | None = None) -> str:
    """Register the deployment on a work pool; a worker of that pool runs it (`prefect worker start`)."""
    ensure_work_pool(pool, pool_type)
    cfg = load_config(root / "params.yaml")
    deployment = build_deployment(root, cfg, cron, None, overrides, name, work_pool=pool, job_variables=job_variables)
    deployment_id = deployment.apply()
    return str(deployment_id)


def setup(cfg: PipelineConfig) -> int:
    """Create (or update) the `gpu` tag concurrency limit: GPU stages of all runs share its slots."""
    from prefect import get_client

    with get_client(sync_client=True) as client:
        client.create_concurrency_limit(tag="gpu", concurrency_limit=cfg.operations.gpu_concurrency)
        limit = client.read_concurrency_limit_by_tag("gpu").concurrency_limit
    return int(limit)


def update_data(root: Path, source: Path, split: str, emit: bool = True) -> dict[str, Any]:
    """Copy a new dataset into data/user, `dvc add` it, point params.yaml at it, emit the event."""
    from components.data.records import file_md5
    from pipelines.params_io import apply_to_params, merged_config

    if not source.is_file():
        raise ValueError(f"{source}: no such file")
    if split not in SPLIT_CHOICES:
        raise ValueError(f"--split {split}: must be one of {', '.join(SPLIT_CHOICES)}")
    rel = Path("data") / "user" / f"{split}{''.join(source.suffixes) or '.jsonl'}"
    target = root / rel
    params = root / "params.yaml"
    merged_config(params, [], [f"data.{split}_path={rel.as_posix()}"])  # a refused setting copies nothing
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(target.name + ".tmp")
    shutil.copyfile(source, tmp)
    tmp.replace(target)
    proc = subprocess.run([sys.executable, "-m", "dvc", "add", "-q", rel.as_posix()], cwd=root, capture_output=True,
                          text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"dvc add {rel} failed:\n{proc.stdout}{proc.stderr}")
    changed = apply_to_params(params, [], [f"data.{split}_path={rel.as_posix()}"])
    md5 = file_md5(target)
    info = {"root": str(root.resolve()), "split": split, "path": rel.as_posix(), "md5": md5,
            "params_changed": changed}
    if emit:
        emit_dataset_updated(root, info)
    return info


def emit_dataset_updated(root: Path, payload: dict[str, Any]) -> str:
    """Send `grpo.dataset.updated` for this repository and wait until it has left the process."""
    from prefect.events import emit_event
    from prefect.events.worker import EventsWorker

    cfg = load_config(root / "params.yaml")
    event = emit_event(event=cfg.operations.trigger_event,
                       resource={"prefect.resource.id": resource_id(root), "prefect.resource.name": root.name},
                       payload=payload)
    EventsWorker.drain_all(timeout=30)
    if event is None:
        raise RuntimeError("the data was copied and recorded, but no event was emitted: no Prefect API is "
                           "configured (set PREFECT_API_URL)")
    return str(event.id)
