"""Evaluate several checkpoints at once: one Prefect task per checkpoint on a chosen task runner.

`process` (default): Prefect's ProcessPoolTaskRunner, one worker process per checkpoint up to
`--workers`; `thread`: a thread pool; `ray`: prefect-ray's RayTaskRunner on the cluster named by
RAY_ADDRESS (`pip install prefect-ray`, then `ray start --head`); `sequential`: one after another in
this process, no Prefect (the reference the parallel runners must match).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from prefect import flow, task

RUNNERS = ("process", "thread", "ray", "sequential")


def evaluate_one(checkpoint: str, root: str, params: str) -> dict[str, Any]:
    """One checkpoint's held-out metrics, plus the process that computed them."""
    from components.config import load_config
    from components.data.paths import Paths
    from components.engine.evaluation.heldout import score_checkpoint

    cfg = load_config(Path(root) / params)
    return {**score_checkpoint(cfg, Path(checkpoint), Paths(root=Path(root))), "pid": os.getpid()}


def task_runner(kind: str, workers: int | None):
    if kind == "process":
        from prefect.task_runners import ProcessPoolTaskRunner

        return ProcessPoolTaskRunner(max_workers=workers)
    if kind == "thread":
        from prefect.task_runners import ThreadPoolTaskRunner

        return ThreadPoolTaskRunner(max_workers=workers)
    if kind == "ray":
        try:
            from prefect_ray import RayTaskRunner
        except ImportError as err:
            raise ValueError("--runner ray needs prefect-ray: pip install -c constraints.txt -e '.[ray]'") from err
        return RayTaskRunner(address=os.environ.get("RAY_ADDRESS"))
    raise ValueError(f"unknown task runner {kind!r} (choose from {', '.join(RUNNERS)})")


def evaluate_many(checkpoints: list[str], root: str = ".", params: str = "params.yaml", runner: str = "process",
                  workers: int | None = None) -> list[dict[str, Any]]:
    """Metrics of each checkpoint, in the order given, computed in parallel by the task runner."""
    root = str(Path(root).resolve())
    checkpoints = [str((Path(root) / c).resolve()) if not Path(c).is_absolute() else c for c in checkpoints]
    if runner == "sequential":
        return [evaluate_one(c, root, params) for c in checkpoints]
    parallel = evaluate_many_flow.with_options(task_runner=task_runner(runner, workers or len(checkpoints)))
    return parallel(checkpoints, root, params)


evaluate_checkpoint = task(name="evaluate-checkpoint", retries=0)(evaluate_one)


@flow(name="evaluate-many", log_prints=True)
def evaluate_many_flow(checkpoints: list[str], root: str, params: str = "params.yaml") -> list[dict[str, Any]]:
    """One task per checkpoint, submitted together: the flow's task runner runs them in parallel."""
    futures = [evaluate_checkpoint.with_options(name=f"evaluate-{Path(c).name}").submit(c, root, params)
               for c in checkpoints]
    return [f.result() for f in futures]


def table(results: list[dict[str, Any]]) -> str:
    lines = ["| checkpoint | held-out mean reward | n |", "|---|---|---|"]
    lines += [f"| {r['checkpoint']} | {r['mean_reward']:.4f} | {r['n']} |" for r in results]
    return "\n".join(lines)
