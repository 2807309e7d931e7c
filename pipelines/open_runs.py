"""The MLflow runs a killed pipeline run could not close (pipelines/flow.py keeps the list)."""

from __future__ import annotations

import json
from pathlib import Path

OPEN_RUNS_FILE = "logs/open-mlflow-runs.json"


class OpenRuns:
    """The MLflow parent runs of this repository's pipeline runs that have not been closed yet: a run adds its own
    when it starts and removes it once its outcome is recorded. One still listed at the next run's start (which
    holds the repository's run lock, so no other run is going on) belongs to a run that was killed: its parent run
    and stages' runs, still RUNNING, are marked KILLED then."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def ids(self) -> list[str]:
        try:
            ids = json.loads(self.path.read_text())
        except (OSError, ValueError):  # none yet (written in one rename, so never cut short by a kill)
            return []
        return [i for i in ids if isinstance(i, str)] if isinstance(ids, list) else []

    def _write(self, ids: list[str]) -> None:
        from components.data.records import write_text_atomic

        write_text_atomic(self.path, json.dumps(ids))

    def add(self, run_id: str) -> None:
        self._write([*self.ids(), run_id])

    def remove(self, run_id: str) -> None:
        self._write([i for i in self.ids() if i != run_id])

    def close_killed(self) -> None:
        """Mark the listed runs' RUNNING runs KILLED (one line saying so); those the server did not answer for stay."""
        from components.runtime.parent_run import run_job

        listed = self.ids()
        if not listed:
            return
        try:
            answer = run_job({"action": "close_killed", "run_ids": listed})
        except Exception:  # noqa: BLE001 - the tracking store away: tried again by the next run
            return
        self._write(answer["left"])
        if answer["marked"]:
            print(f"mlflow: a previous pipeline run was killed before it could close its MLflow runs; marked KILLED: "
                  f"{', '.join(answer['marked'])}", flush=True)
