"""GRPO's metric points reach a real MLflow store: batched by time, and never lost when the stage fails."""

from __future__ import annotations

import pytest
from mlflow.tracking import MlflowClient

from components.config import GRPOConfig
from components.tracking.runs import stage_run
from components.tracking.step_log import StepLog


def _points(store: str, run_id: str) -> list[tuple[int, float]]:
    return [(p.step, p.value) for p in MlflowClient(store).get_metric_history(run_id, "learning/kl")]


def _record(log: StepLog, steps: range) -> None:
    for step in steps:
        log.record(step, {"kl": float(step), "reward_mean": 0.5, "loss": 0.1, "completions_per_s": 1.0})


def test_points_wait_for_the_flush_interval_then_go_together(mlflow_store):
    g = GRPOConfig(steps=6, metrics_every=2, log_every=100)
    with stage_run("step-log", "grpo") as run:
        log = StepLog(run, g, 0, [], is_main=True, flush_s=3600.0)
        _record(log, range(1, 5))
        assert _points(mlflow_store, run.run_id) == []  # two points made, none written yet
        log.flush()
        # each point is its window's mean, at the window's last step
        assert _points(mlflow_store, run.run_id) == [(2, 1.5), (4, 3.5)]


def test_a_zero_interval_writes_each_point_at_once(mlflow_store):
    g = GRPOConfig(steps=6, metrics_every=2, log_every=100)
    with stage_run("step-log", "grpo") as run:
        log = StepLog(run, g, 0, [], is_main=True, flush_s=0.0)
        _record(log, range(1, 3))
        assert _points(mlflow_store, run.run_id) == [(2, 1.5)]
        _record(log, range(3, 5))
        assert _points(mlflow_store, run.run_id) == [(2, 1.5), (4, 3.5)]


def test_pending_points_are_written_when_the_stage_fails(mlflow_store):
    g = GRPOConfig(steps=6, metrics_every=2, log_every=100)
    with pytest.raises(RuntimeError, match="reward server down"), stage_run("step-log", "grpo") as run:
        log = StepLog(run, g, 0, [], is_main=True, flush_s=3600.0)
        _record(log, range(1, 5))
        raise RuntimeError("reward server down")
    assert _points(mlflow_store, run.run_id) == [(2, 1.5), (4, 3.5)]
    assert MlflowClient(mlflow_store).get_run(run.run_id).info.status == "FAILED"
