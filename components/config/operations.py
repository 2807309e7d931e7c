"""How runs are tracked, served, reported on and spread over processes, with those sections' checks."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from components.config.rules import _require


@dataclass
class TrackingConfig:
    """MLflow tracking."""

    experiment: str = "grpo-pipeline"
    """Experiment holding the pipeline's runs."""
    metrics_flush_s: float = 5.0
    """Seconds between writes of GRPO's pending metric points to MLflow (one point per `grpo.metrics_every`
    steps either way). Most of a write's cost is per write: on SQLite about 3.5 ms plus 0.045 ms a metric,
    so ten points in one write cost 1.9 ms each instead of 5. Pending points are written when the stage
    ends, fails or is stopped; a killed process (SIGKILL) loses at most these seconds of them. 0 writes
    each point at once."""


@dataclass
class OperationsConfig:
    """Served and deployed runs (`grpo-pipeline serve | deploy | setup | data update`)."""

    deployment: str = "grpo-pipeline"
    """Prefect deployment name."""
    cron: str | None = None
    """Cron schedule of the served/deployed pipeline (e.g. "0 3 * * *"); null = runs only on triggers."""
    timezone: str = "UTC"
    """Time zone the cron schedule is read in."""
    trigger_event: str = "grpo.dataset.updated"
    """Event (emitted by `grpo-pipeline data update`) that starts a run of this repository's deployment."""
    gpu_concurrency: int = 1
    """Task runs tagged `gpu` (sft, grpo, evaluate) allowed at once on the Prefect server."""
    lock_wait_s: float = 21600.0
    """How long a served run waits for another run of the same repository to finish before failing."""
    stage_retries: int = 2
    """Retries of a stage that failed for a transient reason (tracking server unreachable); never others."""
    retry_delay_s: float = 10.0
    """First retry delay; each further retry waits 3x longer (backoff)."""


@dataclass
class ReportsConfig:
    """Pictures and tables for people: DVC plots, MLflow figures and completion tables."""

    samples_every: int = 100
    """Every N GRPO steps, log a table of sampled completions to MLflow (0 = never)."""
    samples_rows: int = 32
    """Completions per logged sample table."""


@dataclass
class DistributedConfig:
    """Multi-process training of the sft and grpo stages on torch.distributed (DDP)."""

    nproc: int = 1
    """Processes per node; > 1 makes the stage re-launch itself under torchrun (one per GPU, or CPU gloo)."""
    backend: Literal["auto", "gloo", "nccl"] = "auto"
    """Process-group backend; `auto`: nccl on CUDA, gloo on CPU."""
    per_group_sampling: bool = False
    """Seed each prompt group's sampler from (seed, step, prompt position) so completions do not depend
    on how prompts are sharded; always on with more than one process (slower than the batched sampler)."""
    strategy: Literal["ddp", "fsdp2"] = "ddp"
    """ddp: a whole model per process; fsdp2: weights, gradients and optimizer state sharded over the
    processes (torch fully_shard per decoder layer) for models that do not fit one GPU. Not with LoRA."""


def check_operations(ops: OperationsConfig, tracking: TrackingConfig, reports: ReportsConfig) -> None:
    """operations, reports and tracking: schedule, concurrency, retries, sample tables, metric flushes."""
    _require(ops.cron is None or len(ops.cron.split()) in (5, 6), "operations.cron",
             "must be a cron expression with 5 fields (minute hour day month weekday), or null")
    _require(ops.gpu_concurrency >= 1, "operations.gpu_concurrency", "must be >= 1")
    _require(ops.lock_wait_s >= 0, "operations.lock_wait_s", "must be >= 0")
    _require(ops.stage_retries >= 0, "operations.stage_retries", "must be >= 0")
    _require(ops.retry_delay_s >= 0, "operations.retry_delay_s", "must be >= 0")
    _require(bool(ops.deployment.strip()), "operations.deployment", "must not be empty")
    _require(reports.samples_every >= 0, "reports.samples_every", "must be >= 0")
    _require(tracking.metrics_flush_s >= 0, "tracking.metrics_flush_s", "must be >= 0")
    _require(reports.samples_rows >= 1, "reports.samples_rows", "must be >= 1")


def check_distributed(d: DistributedConfig, device: str) -> None:
    """distributed: process count, backend against `device`, fsdp2 over more than one process (its rules
    against LoRA and the batch run in `validate_config`)."""
    _require(d.nproc >= 1, "distributed.nproc", "must be >= 1")
    _require(not (d.backend == "nccl" and device == "cpu"), "distributed.backend",
             "nccl needs CUDA devices; use gloo (or auto) with device: cpu")
    if d.strategy == "fsdp2":
        _require(d.nproc > 1, "distributed.strategy",
                 "fsdp2 shards the model over processes: set distributed.nproc > 1 (or use ddp)")
