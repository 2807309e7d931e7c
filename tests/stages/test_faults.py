"""Injected faults: failing rewards, NaN losses, a full disk, a tracking server outage, SIGKILL during
register, two runs at once, and secrets in the environment."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest
import torch

from components.data.checkpoints import latest_checkpoint, load_checkpoint
from components.errors import StageFailed
from components.stages.grpo import train_grpo

from conftest import (
    BIN,
    FAST_PARAMS,
    LEARN,
    ROOT,
    copy_project,
    kill_new_stages,
    run,
    server_processes,
    setup_stage_inputs,
)


def test_transient_reward_failures_are_skipped_and_logged(tmp_path, mlflow_store, capsys):
    import reward_fixtures

    flaky = ["grpo.steps=5", "grpo.max_reward_failures=2", "grpo.rewards=[{name: 'reward_fixtures:flaky_twice'}]"]
    reward_fixtures._CALLS["flaky"] = 0
    cfg, paths = setup_stage_inputs(tmp_path / "steps", LEARN + flaky + ["evaluate.every=0"])
    train_grpo(cfg, paths)
    out = capsys.readouterr().out
    assert "grpo: step 1 skipped: reward 'reward_fixtures:flaky_twice' raised ConnectionError" in out
    assert "(2 in a row)" in out and (paths.grpo_model / "model.safetensors").exists()
    # The held-out evaluation of the start meets the failure first: it is skipped, training is not stopped.
    reward_fixtures._CALLS["flaky"] = 0
    cfg, paths = setup_stage_inputs(tmp_path / "heldout", LEARN + flaky + ["evaluate.every=2"])
    train_grpo(cfg, paths)
    out = capsys.readouterr().out
    assert ("grpo: held-out evaluation of the start model skipped (reward 'reward_fixtures:flaky_twice' raised "
            "ConnectionError: judge service unavailable)") in out
    assert "grpo: step 1 skipped" in out and (paths.grpo_model / "model.safetensors").exists()


@pytest.mark.parametrize("reward,options,message", [
    ("reward_fixtures:raises", [], "reward 'reward_fixtures:raises' raised RuntimeError: boom"),
    ("reward_fixtures:not_a_number", [], "reward 'reward_fixtures:not_a_number' returned nan"),
    ("reward_fixtures:wrong_length", [], "returned 1 values for 64 completions"),
    ("reward_fixtures:slow", ["grpo.reward_timeout_s=0.5"], "reward 'reward_fixtures:slow' took longer than 0.5s"),
])
def test_persistent_reward_failure_stops_with_the_rule(tmp_path, mlflow_store, reward, options, message):
    cfg, paths = setup_stage_inputs(tmp_path, LEARN + ["grpo.steps=5", "grpo.max_reward_failures=1",
                                                       f"grpo.rewards=[{{name: '{reward}'}}]"] + options)
    started = time.monotonic()
    with pytest.raises(StageFailed) as err:
        train_grpo(cfg, paths)
    assert "rewards failed on 2 steps in a row (grpo.max_reward_failures = 1)" in str(err.value)
    assert message in str(err.value)
    assert time.monotonic() - started < 20 and not paths.grpo_model.exists()


def test_nan_losses_are_skipped_then_stop_with_last_good_checkpoint_kept(tmp_path, mlflow_store, capsys):
    cfg, paths = setup_stage_inputs(tmp_path, LEARN + ["grpo.steps=12", "grpo.checkpoint_every=2"])

    def poison_training_forward(step, policy, metrics):
        # From step 2 on, logits are NaN whenever gradients are on (the loss forward), while sampling
        # (no_grad) still works: the loss and its gradients turn non-finite.
        if step == 2:
            policy.lm_head.register_forward_hook(
                lambda module, args, out: out * float("nan") if torch.is_grad_enabled() else out)

    with pytest.raises(StageFailed, match="more than 3 consecutive steps with non-finite loss or gradients"):
        train_grpo(cfg, paths, callbacks=[poison_training_forward])
    assert "non-finite loss or gradient, 1 update(s) skipped (1 step(s) in a row)" in capsys.readouterr().out
    good = latest_checkpoint(paths.grpo_checkpoints, _run_hash(paths))
    assert good is not None and good.name == "step-0000002"
    from safetensors.torch import load_file
    assert all(torch.isfinite(t).all() for t in load_file(good / "model.safetensors").values())


def test_a_damaged_checkpoint_is_skipped_and_the_rerun_ends_with_the_uninterrupted_weights(tmp_path, mlflow_store,
                                                                                          capsys):
    """The newest checkpoint cut to half its size (a disk error, an interrupted copy): the rerun says so in one
    line, resumes from the intact one before it, and finishes with the weights of a run that was never hurt."""
    from safetensors.torch import load_file

    cfg, paths = setup_stage_inputs(tmp_path, LEARN + ["grpo.steps=6", "grpo.checkpoint_every=2"])
    train_grpo(cfg, paths)
    uninterrupted = load_file(paths.grpo_model / "model.safetensors")
    newest = paths.grpo_checkpoints / "step-0000004"  # checkpoints at 2 and 4 (none at the last step)
    state = newest / "state.pt"
    state.write_bytes(state.read_bytes()[: state.stat().st_size // 2])
    capsys.readouterr()
    train_grpo(cfg, paths)
    out = capsys.readouterr().out
    assert f"grpo: skipped checkpoint {newest}: state.pt does not match its recorded sha256" in out
    assert "grpo: resumed from" in out and "step-0000002 at step 2/6" in out
    assert "Traceback" not in out and "PytorchStreamReader" not in out
    rerun = load_file(paths.grpo_model / "model.safetensors")
    assert rerun.keys() == uninterrupted.keys() and all(torch.equal(rerun[k], uninterrupted[k]) for k in rerun)

    # every checkpoint of the run damaged: it says so and starts over, rather than failing every rerun
    for meta in paths.grpo_checkpoints.glob("step-*/meta.json"):
        meta.write_text(meta.read_text()[:10])
    capsys.readouterr()
    train_grpo(cfg, paths)
    out = capsys.readouterr().out
    assert out.count("its meta.json is missing or unreadable; removed it") == 2
    assert "grpo: no intact checkpoint of this run is left: starting from step 0" in out
    again = load_file(paths.grpo_model / "model.safetensors")
    assert all(torch.equal(again[k], uninterrupted[k]) for k in again)


def test_a_step_the_machine_cannot_allocate_stops_with_one_line_and_the_rerun_resumes(tmp_path, mlflow_store):
    """At step 5 a real allocation the CPU allocator cannot serve (what a too-long completion or batch meets):
    the stage stops with one message naming the step, its memory estimate and the knobs; the checkpoint of step
    4 is kept, and the rerun ends with the weights of a run that never failed."""
    from safetensors.torch import load_file

    cfg, paths = setup_stage_inputs(tmp_path, LEARN + ["grpo.steps=8", "grpo.checkpoint_every=4"])
    train_grpo(cfg, paths)
    uninterrupted = load_file(paths.grpo_model / "model.safetensors")
    import shutil
    shutil.rmtree(paths.grpo_model)
    shutil.rmtree(paths.grpo_checkpoints)

    def too_large(step, policy, metrics):
        if step == 5:
            torch.empty(1 << 52, dtype=torch.uint8)  # 4 PiB: refused by the allocator, as a real overrun is

    with pytest.raises(StageFailed) as err:
        train_grpo(cfg, paths, callbacks=[too_large])
    text = str(err.value)
    assert text.startswith("out of memory at step 5 of 8 (RuntimeError: ") and "can't allocate memory" in text
    assert "a step was estimated at " in text and "lower it with grpo.gradient_checkpointing=always" in text
    assert text.endswith("the checkpoints are kept: rerun to resume") and "\n" not in text
    assert [p.name for p in paths.grpo_checkpoints.glob("step-*")] == ["step-0000004"]
    assert not (paths.grpo_checkpoints.parent / "grpo.running.json").exists()  # said, so no note for the rerun
    train_grpo(cfg, paths)
    rerun = load_file(paths.grpo_model / "model.safetensors")
    assert all(torch.equal(rerun[k], v) for k, v in uninterrupted.items())


@pytest.mark.slow
def test_sigkill_during_evaluate_keeps_the_last_report_and_the_rerun_reproduces_it(tmp_path, mlflow_store,
                                                                                  monkeypatch, stage_server):
    """Killed (SIGKILL) while it scores the trained model: the evaluation already saved is intact, the rerun of
    the same command writes the same report. The evaluation saved first is the stage run in this process, in the
    same folder on the same settings (a process of its own only added its start-up): the report names its models
    relative to that folder, as the command's does."""
    from components.data.paths import Paths
    from components.runtime.stage_server import SERVER_ENV
    from components.stages.evaluate import evaluate

    extra = ["grpo.steps=6", "evaluate.metrics=[reward, pass@4]", "evaluate.pass_k_samples=16",
             "evaluate.batch_size=4", "evaluate.bootstrap_samples=500"]
    cfg, paths = setup_stage_inputs(tmp_path, LEARN + extra)
    train_grpo(cfg, paths)
    monkeypatch.chdir(tmp_path)
    evaluate(cfg, Paths())  # what the command writes in tmp_path
    (tmp_path / "params.yaml").write_text((ROOT / "params.yaml").read_text())
    # The stage forked by a warm stage server (the worker's), as a pipeline run has it.
    env = {**os.environ, SERVER_ENV: stage_server[1]}
    cmd = [sys.executable, "-m", "components.runtime.launch", "evaluate",
           *[x for o in LEARN + extra for x in ("--set", o)]]
    saved = (paths.metrics / "eval.json").read_text()
    already = server_processes(stage_server[0], tmp_path)
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    for line in proc.stdout:  # the baseline is scored; the candidate's scoring is under way
        if line.startswith("evaluate: baseline"):
            # the stage itself, then its launcher
            assert kill_new_stages(stage_server[0], tmp_path, already), "the stage was not forked by the server"
            proc.send_signal(signal.SIGKILL)
            break
    assert proc.wait() == -signal.SIGKILL
    assert (paths.metrics / "eval.json").read_text() == saved
    rerun = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert rerun.returncode == 0 and "Traceback" not in rerun.stdout + rerun.stderr
    assert (paths.metrics / "eval.json").read_text() == saved


@pytest.mark.slow
def test_a_full_disk_during_a_real_run_stops_with_one_line_and_the_rerun_finishes(tmp_path, mlflow_store):
    """The grpo stage on a device that takes no file over 4 MB (RLIMIT_FSIZE: what a full filesystem answers a
    write with): the first checkpoint's optimizer state does not fit, the stage stops with one line naming it,
    leaves no partial checkpoint, and the rerun with space again ends with an uninterrupted run's weights. The
    uninterrupted run is the stage run in this process on the same settings (the weights do not depend on the
    process: a subprocess of its own would only add its start-up)."""
    import resource

    from safetensors.torch import load_file

    extra = ["grpo.steps=8", "grpo.checkpoint_every=4"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")]),
           "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path / 'own.db'}"}  # a small store: its writes fit
    cmd = [sys.executable, "-m", "components.stages.grpo", *[x for o in LEARN + extra for x in ("--set", o)]]
    roots = {name: tmp_path / name for name in ("straight", "full")}
    inputs = {name: setup_stage_inputs(root, LEARN + extra) for name, root in roots.items()}
    for root in roots.values():
        (root / "params.yaml").write_text((ROOT / "params.yaml").read_text())
    train_grpo(*inputs["straight"])  # uninterrupted, with room

    def full_device():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # writes fail with EFBIG instead of killing the process
        resource.setrlimit(resource.RLIMIT_FSIZE, (4 << 20, resource.RLIM_INFINITY))

    full = subprocess.run(cmd, cwd=roots["full"], env=env, capture_output=True, text=True, timeout=600,
                          preexec_fn=full_device)
    assert full.returncode == 1 and "Traceback" not in full.stdout + full.stderr
    last = full.stderr.strip().splitlines()[-1]
    assert last.startswith("error: could not write checkpoint step 4 in checkpoints/grpo (")
    assert "the device is full, the file too large for it, or the directory not writable" in last
    assert last.endswith("no earlier checkpoint; make room and rerun to resume")
    assert not list((roots["full"] / "checkpoints" / "grpo").iterdir())  # no partial checkpoint left
    train_grpo(*inputs["full"])  # the rerun with room again: here, as the uninterrupted run
    a, b = (load_file(str(roots[n] / "models" / "grpo" / "model.safetensors")) for n in ("straight", "full"))
    assert all(torch.equal(a[k], b[k]) for k in a)


def _run_hash(paths):
    import json
    return json.loads(next(paths.grpo_checkpoints.glob("step-*/meta.json")).read_text())["run_hash"]


def test_full_disk_while_checkpointing_keeps_the_previous_checkpoint(tmp_path):
    code = f"""
import resource, signal, sys, torch
sys.path.insert(0, {str(ROOT)!r})
from components.data.checkpoints import CheckpointWriteError, save_checkpoint
model = torch.nn.Linear(512, 512)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
save_checkpoint(__import__("pathlib").Path({str(tmp_path / 'ckpt')!r}), 1, "h", model, opt, {{"step": 1}})
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)   # a full device: writes fail with EFBIG instead of killing us
resource.setrlimit(resource.RLIMIT_FSIZE, (256 << 10, resource.RLIM_INFINITY))
with torch.no_grad():
    model.weight.add_(1.0)
try:
    save_checkpoint(__import__("pathlib").Path({str(tmp_path / 'ckpt')!r}), 2, "h", model, opt, {{"step": 2}})
except CheckpointWriteError as err:
    print("WRITE FAILED", err)
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert "WRITE FAILED could not write checkpoint step 2" in proc.stdout, proc.stderr
    assert "File too large" in proc.stdout and "step-0000001 kept" in proc.stdout
    root = tmp_path / "ckpt"
    assert sorted(p.name for p in root.iterdir()) == ["step-0000001"]  # no half-written or temp directory
    assert latest_checkpoint(root, "h").name == "step-0000001"
    model, opt = torch.nn.Linear(512, 512), None
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    assert load_checkpoint(root / "step-0000001", model, opt)["step"] == 1


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_mlflow(tmp_path: Path, port: int) -> subprocess.Popen:
    env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
    proc = subprocess.Popen([str(BIN / "mlflow"), "server", "--host", "127.0.0.1", "--port", str(port),
                             "--workers", "1", "--backend-store-uri", f"sqlite:///{tmp_path / 'server.db'}",
                             "--artifacts-destination", str(tmp_path / "server-artifacts")],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env, start_new_session=True)
    deadline = time.time() + 90
    while time.time() < deadline:  # answering HTTP, not only accepting connections
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as answer:
                if answer.status == 200:
                    return proc
        except OSError:
            time.sleep(0.3)
    proc.kill()
    raise RuntimeError("mlflow server did not start")


def _stop(proc: subprocess.Popen) -> None:
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def _grpo_points(tracking: str) -> list[tuple[str, tuple[str, list[int]]]]:
    """(run name, (status, steps of its `learning/reward_mean` points)) of every run on the server."""
    from mlflow.tracking import MlflowClient

    c = MlflowClient(tracking)
    runs = c.search_runs([e.experiment_id for e in c.search_experiments()])
    return [(r.info.run_name, (r.info.status, sorted(p.step for p in c.get_metric_history(r.info.run_id,
                                                                                           "learning/reward_mean"))))
            for r in runs]


@pytest.mark.slow
@pytest.mark.integration
def test_a_tracking_outage_costs_no_training_and_its_records_arrive_later(tmp_path, mlflow_store, monkeypatch,
                                                                         stage_server):
    """Server down from the start: GRPO and evaluate run to the end logging to the on-disk queue, say so once,
    show no traceback; register, which needs the server, stops with one line; rerun when the server is back, it
    sends the queue first, then registers. Server gone mid-run and back: the run sends its queue
    itself and its MLflow run ends complete. Both end with the weights of a run that never lost its server.
    The online and down runs are 8 steps (4 logged points each, so "say so once" still spans several failed sends,
    and the weights are compared whatever the length); only the midway run is long (40 slow steps), as the server
    must die and come back while it runs. The online run is the stage in this process (in its own folder, with the
    same settings and environment): a process of its own only added its start-up; the down and midway runs, which
    the outage is injected into, and the later stages are commands of their own (stage launchers, forked by one warm
    stage server as a pipeline run's are)."""
    from safetensors.torch import load_file

    from components.runtime.stage_server import SERVER_ENV

    steps = ["grpo.steps=8", "grpo.checkpoint_every=4", "grpo.log_every=4", "grpo.metrics_every=2"]
    port = _free_port()
    uri = f"http://127.0.0.1:{port}"
    # The stage commands are forked by a warm stage server (the worker's), as a pipeline run has them (their imports
    # paid once); the suite's PYTHONPATH finds the tests' reward fixtures there.
    env = {**os.environ, "MLFLOW_TRACKING_URI": uri, "GRPO_TRACKING_RETRY_S": "1",
           "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "1", "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
           SERVER_ENV: stage_server[1]}
    sets = [x for o in LEARN + steps for x in ("--set", o)]
    grpo = [sys.executable, "-m", "components.runtime.launch", "grpo", *sets]
    roots = {name: tmp_path / name for name in ("online", "down", "midway")}
    inputs = {name: setup_stage_inputs(root, LEARN + steps) for name, root in roots.items()}
    for root in roots.values():
        (root / "params.yaml").write_text((ROOT / "params.yaml").read_text())
    server = _start_mlflow(tmp_path, port)
    try:
        with monkeypatch.context() as online:  # the online run in this process, as the command runs it
            online.chdir(roots["online"])
            for key in ("MLFLOW_TRACKING_URI", "GRPO_TRACKING_RETRY_S", "MLFLOW_HTTP_REQUEST_MAX_RETRIES",
                        "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR"):
                online.setenv(key, env[key])
            train_grpo(*inputs["online"])
        assert not (roots["online"] / ".tracking-outbox" / "queue.jsonl").exists()  # all sent while it ran
        _stop(server)

        down = subprocess.run(grpo, cwd=roots["down"], env=env, capture_output=True, text=True, timeout=600)
        assert down.returncode == 0, down.stdout[-2000:] + down.stderr[-2000:]
        assert down.stdout.count(f"tracking: the MLflow tracking server at {uri} does not answer") == 1
        assert "Traceback" not in down.stdout + down.stderr and "Retrying" not in down.stderr
        outbox = roots["down"] / ".tracking-outbox"
        assert (outbox / "queue.jsonl").exists() and "Retrying" in (outbox / "http.log").read_text()

        stage = lambda name: subprocess.run([sys.executable, "-m", "components.runtime.launch", name, *sets],  # noqa: E731
                                            cwd=roots["down"], env=env, capture_output=True, text=True, timeout=600)
        evaluate = stage("evaluate")  # needs no server either
        assert evaluate.returncode == 0 and "does not answer" in evaluate.stdout, evaluate.stderr[-2000:]
        register = stage("register")  # needs the server: one line, the way to finish later
        assert register.returncode == 1 and "Traceback" not in register.stdout + register.stderr
        assert register.stderr.strip().splitlines()[-1].startswith(
            f"error: the MLflow tracking server at {uri} did not answer after bounded retries")
        assert "registering a model needs it" in register.stderr and "rerun when it is back" in register.stderr

        server = _start_mlflow(tmp_path, port)  # back: the next stage sends what was queued, then registers
        register = stage("register")
        assert register.returncode == 0, register.stderr[-2000:]
        assert "tracking: the tracking server answers again: sent " in register.stdout
        assert not (outbox / "queue.jsonl").exists()
        assert sorted(name for name, _ in _grpo_points(uri)) == ["evaluate", "grpo", "grpo", "register"]

        # 40 slow steps, every second one sends its points; from its 30th reward call the run waits for the hold
        # file to go, so the server is back before the run can end on a machine of any speed
        hold = tmp_path / "hold"
        hold.touch()
        slowly = [*grpo, "--set",
                  "grpo.rewards=[{name: 'reward_fixtures:starts_with_one_until_released', weight: 1.0}]",
                  "--set", "tracking.metrics_flush_s=0", "--set", "grpo.steps=40"]
        proc = subprocess.Popen(slowly, cwd=roots["midway"], env={**env, "GRPO_TEST_HOLD": str(hold)},
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        lines: list[str] = []
        reader = threading.Thread(target=lambda: lines.extend(iter(proc.stdout.readline, "")), daemon=True)
        reader.start()
        deadline = time.time() + 300
        while time.time() < deadline and not any(line.startswith("grpo: step 4/") for line in lines):
            time.sleep(0.05)
        _stop(server)  # gone mid-run ...
        while time.time() < deadline and not any("does not answer" in line for line in lines):
            time.sleep(0.05)
        server = _start_mlflow(tmp_path, port)  # ... and back before the run ends
        hold.unlink()
        proc.wait(timeout=600)
        reader.join(timeout=10)
        out, err = "".join(lines), proc.stderr.read()
        assert proc.returncode == 0, out[-2000:] + err[-2000:]
        assert "grpo: step 40/40" in out and out.index("answers again: sent ") < out.index("grpo: step 40/40")
        assert "Traceback" not in out + err
        runs = sorted(v for k, v in _grpo_points(uri) if k == "grpo")
        assert runs == [("FINISHED", list(range(2, 9, 2)))] * 2 + [  # online, down (sent at the next start)
            ("FINISHED", list(range(2, 41, 2)))]  # midway (sent within the run)
    finally:
        _stop(server)
    weights = [load_file(str(roots[name] / "models" / "grpo" / "model.safetensors")) for name in ("online", "down")]
    assert all(torch.equal(weights[1][k], v) for k, v in weights[0].items())  # logging offline changes nothing


def _kill_after_first_write(cmd: list[str], cwd: Path, env: dict[str, str], store: Path, delay: float,
                            server: subprocess.Popen) -> bool:
    """Start `cmd` (a stage's launcher, which the warm stage `server` forks the stage for, as a pipeline run has it),
    SIGKILL the forked stage process `delay` seconds after its first write to the SQLite file `store` (or its
    journal), then its launcher; True when it had written and was still running at the kill."""
    def stamp() -> list[int]:
        return [f.stat().st_mtime_ns for f in sorted(store.parent.glob(store.name + "*"))]

    before, already = stamp(), server_processes(server, cwd)  # what already works in `cwd` under the server
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 300
    while proc.poll() is None and stamp() == before and time.time() < deadline:
        time.sleep(0.002)
    time.sleep(delay)
    writing = proc.poll() is None and stamp() != before
    killed = kill_new_stages(server, cwd, already)  # the process writing to the store
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    return writing and bool(killed)


@pytest.mark.slow
def test_sigkill_during_register_never_leaves_a_broken_champion(tmp_path, stage_server):
    from mlflow.tracking import MlflowClient

    from components.runtime.stage_server import SERVER_ENV
    from pipelines.params_io import apply_to_params

    repo = copy_project(tmp_path / "repo")
    env = {"MLFLOW_TRACKING_URI": f"sqlite:///{repo / 'mlflow.db'}"}
    apply_to_params(repo / "params.yaml", [], FAST_PARAMS)
    # One warm stage server for the whole test (the worker's), as a pipeline run has one: the stages up to evaluate,
    # then each register forked from it (its imports, which outlast the registration, paid once).
    server = stage_server
    warm = {**os.environ, **env, SERVER_ENV: server[1]}
    run([str(BIN / "dvc"), "repro", "evaluate"], repo, env=warm)
    client = MlflowClient(tracking_uri=env["MLFLOW_TRACKING_URI"])
    register = [sys.executable, "-m", "components.runtime.launch", "register"]
    # Each kill lands a delay after the stage first writes to the store, not after a fixed time from its start.
    hits = 0
    for delay in (0.0, 0.1, 0.25, 0.5):
        hits += _kill_after_first_write(register, repo, warm, repo / "mlflow.db", delay, server[0])
        try:
            champion = client.get_model_version_by_alias("grpo-addition", "champion")
        except Exception:  # noqa: BLE001 - no champion yet is fine
            champion = None
        if champion is not None:
            assert champion.tags.get("registration") == "complete" and "lineage.candidate_md5" in champion.tags
            assert client.list_artifacts(champion.run_id, "eval"), "champion without its evaluation artifacts"
    assert hits >= 2, f"only {hits} of 4 kills landed after register began writing and before it ended"
    run(register, repo, env=warm)
    versions = client.search_model_versions("name = 'grpo-addition'")
    assert len(versions) == 1, [(v.version, v.tags.get("registration")) for v in versions]
    only = versions[0]
    assert only.tags["registration"] == "complete"
    assert str(client.get_model_version_by_alias("grpo-addition", "champion").version) == str(only.version)
    run(register, repo, env=warm)  # and once more: still exactly one version
    assert len(client.search_model_versions("name = 'grpo-addition'")) == 1


SECRETS = {"MLFLOW_TRACKING_TOKEN": "tok-7f3a9e", "AWS_SECRET_ACCESS_KEY": "aws-2b8c1d",
           "MY_SERVICE_PASSWORD": "pw-5e6f7a", "HF_TOKEN": "hf-9d0c1b"}


@pytest.mark.slow
def test_concurrent_runs_are_refused_and_secrets_never_logged(tmp_path, prefect_home):
    repo = copy_project(tmp_path / "repo")
    env = {"MLFLOW_TRACKING_URI": f"sqlite:///{repo / 'mlflow.db'}", "PREFECT_HOME": prefect_home(tmp_path / "prefect"),
           **SECRETS}
    secret_option = "grpo.rewards=[{name: exact_match, weight: 1.0, options: {api_token: opt-4c4c4c}}]"
    cli = [str(BIN / "grpo-pipeline"), "run"] + [x for o in FAST_PARAMS + [secret_option] for x in ("--set", o)]
    first = subprocess.Popen(cli, cwd=repo, env={**os.environ, **env}, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True)
    lock = repo / ".grpo-pipeline.lock"
    deadline = time.time() + 60
    # the lock is taken before the run writes its overrides to params.yaml: wait for both, else the snapshot
    # below can be the file as it was before the first run wrote it
    while time.time() < deadline and not (lock.exists() and "pid" in lock.read_text()
                                          and "opt-4c4c4c" in (repo / "params.yaml").read_text()):
        time.sleep(0.1)
    params_during = (repo / "params.yaml").read_text()
    second = run([str(BIN / "grpo-pipeline"), "run", "--set", "grpo.kl_beta=0.5"], repo, env=env, check=False)
    assert second.returncode == 3
    assert "a pipeline run in this repository is already running (pid" in second.stdout
    assert (repo / "params.yaml").read_text() == params_during  # the refused run changed nothing
    out, _ = first.communicate(timeout=900)
    assert first.returncode == 0, out[-3000:]

    # Everything logged or tracked: console output, MLflow's store and artifacts, Prefect's database.
    # (params.yaml and dvc.lock are the user's own configuration, where they typed the option.)
    logged = [out, second.stdout]
    for path in [repo / "mlflow.db", *(repo / "mlruns").rglob("*"), *(tmp_path / "prefect").rglob("*")]:
        if path.is_file():
            logged.append(path.read_bytes().decode("latin-1"))
    assert len(logged) > 5
    for name, value in {**SECRETS, "reward option api_token": "opt-4c4c4c"}.items():
        assert not any(value in text for text in logged), f"{name} leaked into logs or tracking"
