"""The pipeline's MLflow parent run, opened, updated and closed by a small job instead of the flow.

`python -m components.runtime.parent_run REQUEST.json` reads one request, does it, and writes the answer
to REQUEST.json.out. The flow sends these jobs to the warm stage server (pipelines/flow.py,
ParentRun), which forks a child that has MLflow imported already: the CLI itself never imports
MLflow. When it did, its MLflow import and the first schema creation shared the GIL with Prefect's
import, and the first stage started later.

Requests:
  {"action": "open", "experiment": NAME}
      -> {"experiment_id": ...}; creates the store's schema (a fresh SQLite store: ~1.5 s) and the
      experiment, so the CLI asks for it first thing, while it is still importing Prefect
  {"action": "start", "experiment": NAME, "params": {...}, "tags": {...}}
      -> {"run_id": ..., "experiment_id": ...}; logs the params and the installed package list
  {"action": "update", "run_id": ID, "metrics": {...}, "tags": {...}, "status": "FINISHED" | null}
      -> {}
  {"action": "close_killed", "run_ids": [ID, ...]}
      -> {"marked": [run names], "left": [ids not reached]}; the runs of pipeline runs that were killed
"""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path
from typing import Any

from components.tracking.outbox import Outbox
from components.tracking.runs import PARENT_RUN_ENV, StageRun, experiment_id, start_run


def open_store(experiment: str) -> dict[str, str]:
    return {"experiment_id": experiment_id(experiment)}


def start(experiment: str, params: dict[str, Any], tags: dict[str, str], run_name: str = "pipeline") -> dict[str, str]:
    run = start_run(experiment, run_name, tags=tags)
    if run.offline:  # said just now: the run's stages, which carry its id, do not say it again
        Outbox().announce_outage(run.run_id)
    run.log_params(params)
    log_environment(run)
    return {"run_id": run.run_id, "experiment_id": None if run.offline else experiment_id(experiment)}


def update(run_id: str, metrics: dict[str, float] | None = None, tags: dict[str, Any] | None = None,
           status: str | None = None) -> dict:
    os.environ[PARENT_RUN_ENV] = run_id  # this job is the run's own: an outage it meets was said once already
    run = StageRun(run_id)
    if metrics:
        run.log_metrics(metrics)
    if tags:
        run.set_tags(tags)
    if status:
        run.terminate(status)
    return {}


def close_killed(run_ids: list[str]) -> dict[str, list[str]]:
    """Mark KILLED what a killed pipeline run left RUNNING: its parent run and its stages' runs (a SIGKILL, a lost
    machine: nothing of the run could close them). Returns the names of the runs marked, and the ids it could not
    look at (the server away: tried again by the next run)."""
    from components.tracking.outbox import Outbox
    from components.tracking.runs import client

    c, outbox = client(), Outbox()
    marked, left = [], []
    for run_id in run_ids:
        server_id = outbox.resolve(run_id)
        if not server_id or server_id.startswith("offline-"):
            left.append(run_id)  # created offline and never sent: nothing on the server to close yet
            continue
        try:
            parent = c.get_run(server_id)
            children = c.search_runs([parent.info.experiment_id],
                                     filter_string=f"tags.mlflow.parentRunId = '{server_id}'")
            for run in [parent, *children]:
                if run.info.status == "RUNNING":
                    c.set_terminated(run.info.run_id, status="KILLED")
                    marked.append(run.info.run_name or run.info.run_id)
        except Exception:  # noqa: BLE001 - the server away or the run gone: the next run tries again
            left.append(run_id)
    return {"marked": marked, "left": left}


def log_environment(run: StageRun) -> None:
    """The installed package list (name==version), so a run's stack can be recovered."""
    from importlib.metadata import distributions

    packages = sorted({p for p in (installed_name_version(d) for d in distributions()) if p})
    run.log_text("\n".join(packages) + "\n", "environment/packages.txt")


def installed_name_version(dist) -> str | None:
    """`name==version`, from the `name-version.dist-info` folder name where there is one.

    Parsing every package's METADATA file cost about a second per run; the folder name carries the
    same two fields. Names are written in their normalised form (PEP 503), so each package appears once.
    """
    folder = getattr(dist, "_path", None)
    if folder is not None and folder.name.endswith(".dist-info") and "-" in folder.name:
        name, version = folder.name[: -len(".dist-info")].split("-", 1)
    else:
        name, version = dist.metadata["Name"], dist.version
    return f"{re.sub(r'[-_.]+', '-', name).lower()}=={version}" if name else None


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m components.runtime.parent_run REQUEST.json", file=sys.stderr)
        return 2
    path = Path(args[0])
    request = json.loads(path.read_text())
    action = request.pop("action")
    answer = {"open": open_store, "start": start, "update": update, "close_killed": close_killed}[action](**request)
    path.with_name(path.name + ".out").write_text(json.dumps(answer))
    return 0


def run_job(request: dict[str, Any]) -> dict[str, Any]:
    """Run one request in the warm stage server (GRPO_STAGE_SERVER) when there is one, else here."""
    import os
    import tempfile

    from components.runtime.stage_client import run_remote
    from components.runtime.stage_server import SERVER_ENV

    with tempfile.TemporaryDirectory(prefix="grpo-parent-run-") as folder:
        path = Path(folder) / "request.json"
        path.write_text(json.dumps(request))
        server = os.environ.get(SERVER_ENV)
        code = run_remote(server, "parent_run", [str(path)]) if server else None
        if code is None:
            code = main([str(path)])
        if code != 0:
            raise RuntimeError(f"MLflow parent run: '{request['action']}' failed (exit {code}; its error is above)")
        return json.loads(path.with_name(path.name + ".out").read_text())


if __name__ == "__main__":
    sys.exit(main())
