"""One door for the user's code (components/user_code.py): whatever a reward raises, `SystemExit` and
`KeyboardInterrupt` included, is named, wherever the reward is called (SFT's stop check, GRPO's steps and its
held-out probe, evaluate); a stop signal that arrives meanwhile stays a stop; a process that dies inside the
reward is reported by the stage's parent in one line, and no note is left to be misread afterwards."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from components.config import RewardSpec
from components.engine.rewards.rewards import RewardError, RewardModel

from conftest import LEARN, ROOT, committed_params, setup_stage_inputs


@pytest.mark.parametrize("reward,raised", [
    ("exits", "SystemExit: 1"),
    ("interrupts", "KeyboardInterrupt"),
    ("runs_out_of_memory", "MemoryError: cannot allocate the judge's batch"),
])
def test_whatever_a_reward_raises_is_named(reward, raised):
    rewards = RewardModel([RewardSpec(name=f"reward_fixtures:{reward}", weight=1.0)])
    with pytest.raises(RewardError) as err:
        rewards(["1+1="], ["2"], {"answer": ["2"]})
    assert str(err.value) == f"reward 'reward_fixtures:{reward}' raised {raised}"


STOP_DURING_REWARD = """
import os, signal, time
from components.config import RewardSpec
from components.engine.rewards.rewards import RewardModel
from components.interruptions import StageInterrupted, stop_on_signals

def catches_the_stop(prompts, completions, **_):  # a reward that turns the Ctrl-C into an error of its own
    try:
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(5)
    except KeyboardInterrupt:
        raise RuntimeError("cleanup failed")

stop_on_signals()
try:
    RewardModel([RewardSpec(name="reward_fixtures:starts_with_one")])  # resolvable; the function is swapped in
    rewards = RewardModel([])
    rewards.components = [("mine:catches_the_stop", catches_the_stop, 1.0, {})]
    rewards(["p"], ["c"], {})
except StageInterrupted as stop:
    print("STOPPED", stop)
"""


def test_a_stop_signal_while_a_reward_runs_is_still_a_stop():
    """Ctrl-C during a reward stops the stage as it does anywhere else, even when the reward reacts to it by raising
    an error of its own: the reward is not blamed for the user's Ctrl-C."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")])}
    proc = subprocess.run([sys.executable, "-c", STOP_DURING_REWARD], env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.stdout.strip() == "STOPPED SIGINT", proc.stdout + proc.stderr


def _stage(name: str, root, overrides: list[str], server: str) -> subprocess.CompletedProcess:
    """The stage's command, forked by the warm stage server at `server` (the worker's), as a pipeline run has it."""
    from components.runtime.stage_server import SERVER_ENV

    cmd = [sys.executable, "-m", "components.runtime.launch", name, *[x for o in overrides for x in ("--set", o)]]
    return subprocess.run(cmd, cwd=root, env={**os.environ, SERVER_ENV: server}, capture_output=True, text=True,
                          timeout=600)


def test_a_reward_that_exits_is_named_at_every_place_it_is_called(tmp_path, mlflow_store, capsys, stage_server):
    """`sys.exit(1)` in the reward: GRPO skips the step by its rule and stops naming it, its held-out probe skips
    the evaluation; evaluate and SFT's stop check stop with one line naming the reward, no traceback."""
    from components.errors import StageFailed
    from components.stages.grpo import train_grpo

    exits = ["grpo.rewards=[{name: 'reward_fixtures:exits'}]"]
    steps = ["grpo.steps=2", "grpo.max_reward_failures=1", "evaluate.every=2", "evaluate.during_training_n=8"]
    cfg, paths = setup_stage_inputs(tmp_path, LEARN + steps + exits)
    (tmp_path / "params.yaml").write_text((committed_params()).read_text())
    with pytest.raises(StageFailed) as err:
        train_grpo(cfg, paths)
    assert "rewards failed on 2 steps in a row (grpo.max_reward_failures = 1); last error: reward " \
           "'reward_fixtures:exits' raised SystemExit: 1" in str(err.value)
    assert "grpo: held-out evaluation of the start model skipped (reward 'reward_fixtures:exits' raised " \
           "SystemExit: 1)" in capsys.readouterr().out

    assert _stage("grpo", tmp_path, LEARN + steps, stage_server[1]).returncode == 0  # a model to evaluate
    for stage, extra, where in (("evaluate", ["evaluate.metrics=[reward]"], ""),
                                ("sft", ["sft.enabled=true", "sft.check_every=1"],
                                 " (in SFT's stop check, sft.stop_at_reward)")):
        proc = _stage(stage, tmp_path, LEARN + steps + extra + exits, stage_server[1])
        assert proc.returncode == 1 and "Traceback" not in proc.stdout + proc.stderr, proc.stderr[-2000:]
        assert proc.stderr.strip().splitlines()[-1] == (
            f"error: {stage}: reward 'reward_fixtures:exits' raised SystemExit: 1{where}; nothing of this stage "
            "was kept: fix it and rerun")
        assert not (tmp_path / "checkpoints" / f"{stage}.running.json").exists()


@pytest.mark.slow
def test_a_stage_that_dies_inside_a_reward_is_reported_by_its_parent(tmp_path, mlflow_store, monkeypatch):
    """The reward ends the process (`os._exit(3)`, as a C extension's abort would) or the process is killed while it
    scores (the out-of-memory killer's SIGKILL): the stage's launcher, which saw it end, says in one line which
    reward was scoring and how the process ended, passes a signal on as that signal, and leaves no note behind for
    the rerun to misread as an out-of-memory kill."""
    from components.runtime.stage_server import SERVER_ENV, start_server, stop_server

    steps = ["grpo.steps=3", "evaluate.every=0"]
    setup_stage_inputs(tmp_path, LEARN + steps)
    (tmp_path / "params.yaml").write_text((committed_params()).read_text())
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(ROOT), str(ROOT / "tests")]))
    server = start_server(str(tmp_path))
    try:
        for reward, ended in (("ends_the_process", "exit code 3"), ("is_killed", "signal SIGKILL")):
            sets = [x for o in LEARN + steps + [f"grpo.rewards=[{{name: 'reward_fixtures:{reward}'}}]"]
                    for x in ("--set", o)]
            proc = subprocess.run([sys.executable, "-m", "components.runtime.launch", "grpo", *sets], cwd=tmp_path,
                                  env={**os.environ, SERVER_ENV: server[1]}, capture_output=True, text=True,
                                  timeout=600)
            assert proc.returncode == (3 if reward == "ends_the_process" else -9), proc.stderr[-2000:]
            assert proc.stderr.strip().splitlines()[-1] == (
                f"error: grpo: the stage ended while reward 'reward_fixtures:{reward}' was scoring ({ended}) at step 1 "
                "of 3; no checkpoint yet: the user's code ended the process; fix it and rerun")
            assert "Traceback" not in proc.stdout + proc.stderr
            assert not (tmp_path / "checkpoints" / "grpo.running.json").exists()  # said: nothing left to misread
    finally:
        stop_server(*server)
