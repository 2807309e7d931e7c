"""Start the slow services of a pipeline run side by side instead of one after another.

A run needs three things that each take seconds to start: the warm stage interpreter (torch,
transformers, MLflow imports), Prefect's temporary API server (when no PREFECT_API_URL is set),
and the MLflow store (a fresh SQLite store creates its schema). Each is started here in the
background as soon as the CLI knows it will run the flow; the flow then finds them ready.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path


def start_prefect_api() -> threading.Thread | None:
    """Prefect's temporary server, started early (the flow reuses the same singleton)."""
    from prefect.settings import PREFECT_API_URL, PREFECT_SERVER_EPHEMERAL_ENABLED

    if PREFECT_API_URL.value() or not PREFECT_SERVER_EPHEMERAL_ENABLED.value():
        return None

    def start() -> None:
        from prefect.server.api.server import SubprocessASGIServer

        SubprocessASGIServer().start()

    thread = threading.Thread(target=start, name="prefect-api-start", daemon=True)
    thread.start()
    return thread


def open_tracking_store(root: Path, experiment: str) -> threading.Thread:
    """Connect to (and, the first time, create) the MLflow store and the run's experiment."""
    from components.tracking import experiment_id, tracking_uri

    os.environ.setdefault("MLFLOW_TRACKING_URI", tracking_uri(root))
    thread = threading.Thread(target=experiment_id, args=(experiment,), name="mlflow-store-open", daemon=True)
    thread.start()
    return thread


def wait_for(threads: list[threading.Thread | None], timeout_s: float = 300.0) -> None:
    for thread in threads:
        if thread is not None:
            thread.join(timeout_s)
