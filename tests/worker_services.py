"""The services each test worker starts once and shares with every pipeline run it makes, as a team runs them: a
warm stage server and a Prefect API. Each is named in the environment the runs inherit; a test of what a run does
without them (its own stage server, its own temporary Prefect API) carries a marker that hides it."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def runs_pipelines(session: pytest.Session) -> bool:
    """Whether the session holds a `slow` or `integration` test (the ones that run pipelines): a session of quick
    tests (the suite runs some inside its own tests) would start the services for nothing."""
    return any(item.get_closest_marker("slow") or item.get_closest_marker("integration") for item in session.items)


@pytest.fixture(scope="session", autouse=True)
def _one_stage_server_per_worker(request):
    """One warm stage server (components/runtime/stage_server.py) per worker, named in the environment that every
    pipeline run of this worker inherits: runs, flows and `dvc repro` fork their stages from it instead of each
    importing torch, transformers, MLflow and Great Expectations again. The project copies the tests run in hold
    this working tree's code, which the server imported. A test of what a run's own server does (kills of the
    whole run, runs side by side, the server's own life) is marked `own_stage_server`."""
    from components.runtime.stage_server import SERVER_ENV, start_server, stop_server

    if not runs_pipelines(request.session):
        yield None
        return
    server = start_server(str(ROOT))
    os.environ[SERVER_ENV] = server[1]
    yield server
    os.environ.pop(SERVER_ENV, None)
    stop_server(*server)


@pytest.fixture(scope="session", autouse=True)
def _one_prefect_api_per_worker(request):
    """One Prefect API per worker (the server a run's temporary API is: pipelines/warmup.py), in PREFECT_API_URL for
    every pipeline run of this worker, its database in the worker's Prefect home: each run then reports to a
    configured API, as runs do where a team keeps a Prefect server, instead of starting a temporary one of its own
    (seconds of CPU, for each of the suite's pipeline runs). A test of the temporary API, or one that reads the flow
    runs in its own Prefect home, is marked `own_prefect_api`."""
    from pipelines.warmup import TemporaryPrefectAPI

    class WorkerAPI(TemporaryPrefectAPI):
        # No automations on this API: its trigger service would re-read their state every few seconds for nothing,
        # about two fifths of what an idle API spends.
        SETTINGS = {**TemporaryPrefectAPI.SETTINGS, "PREFECT_SERVER_SERVICES_TRIGGERS_ENABLED": "false"}

    if not runs_pipelines(request.session):
        yield None
        return
    # The test run's migrated database (conftest.py's prefect_home, asked for only here: a session of quick tests
    # migrates none), not a migration per worker.
    request.getfixturevalue("prefect_home")(Path(os.environ["PREFECT_HOME"]))
    api = WorkerAPI()
    api.start()
    api.wait_ready()
    os.environ["PREFECT_API_URL"] = api.url
    yield api
    os.environ.pop("PREFECT_API_URL", None)
    api.stop()


@pytest.fixture(autouse=True)
def _own_services_when_marked(request, _environment_put_back):
    """Tests marked `own_stage_server` or `own_prefect_api` see no shared one: their runs start their own, as a
    user's do (the environment is put back after the test by _environment_put_back)."""
    from components.runtime.stage_server import SERVER_ENV

    if request.node.get_closest_marker("own_stage_server"):
        os.environ.pop(SERVER_ENV, None)
    if request.node.get_closest_marker("own_prefect_api"):
        os.environ.pop("PREFECT_API_URL", None)
