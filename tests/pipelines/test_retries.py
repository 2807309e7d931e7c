"""User code is never retried as an outage: a user environment whose `reset` raises `ConnectionError` fails the run
after one attempt of its stage, with its own report, whatever the retry settings; a real `grpo-pipeline run`."""

from __future__ import annotations

import re
import time

import pytest

from conftest import BIN, FAST_PARAMS, ROOT, copy_committed_project, run

pytestmark = pytest.mark.slow


def test_a_user_environment_raising_connection_error_is_reported_after_one_attempt(tmp_path, prefect_home):
    from environment_fixtures import build_chat_model

    repo = copy_committed_project(tmp_path / "repo")
    model = build_chat_model(tmp_path / "tiny-chat")
    env = {"MLFLOW_TRACKING_URI": f"sqlite:///{repo / 'mlflow.db'}", "PREFECT_HOME": prefect_home(tmp_path / "prefect"),
           "PYTHONPATH": str(ROOT / "tests")}
    overrides = FAST_PARAMS + [
        f"model.name_or_path={model}", "sft.enabled=false", "grpo.environment=environment_fixtures:game_server_down",
        "grpo.rewards=[{name: environment_reward, weight: 1.0}]", "grpo.max_completion_length=16",
        "operations.stage_retries=2", "operations.retry_delay_s=1"]  # a retry, were there one, would come at once
    started = time.monotonic()
    proc = run([str(BIN / "grpo-pipeline"), "run", *[x for o in overrides for x in ("--set", o)]], repo,
               check=False, env=env)
    out = proc.stdout
    assert proc.returncode == 1, out[-3000:]
    ran = [line.split("'")[1] for line in out.splitlines() if line.startswith("Running stage '")]
    assert len(ran) == len(set(ran)), f"a stage ran more than once: {ran}"
    errors = [line for line in out.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and re.fullmatch(
        r"error: grpo: environment_fixtures:game_server_down: reset raised ConnectionError: game server unreachable "
        r"at 10\.0\.0\.7:7777 \(Connection refused\) \(record '[^']+'\)", errors[0]), out[-3000:]
    assert "did not answer" not in out and "runs again in" not in out and "Retry 1/2" not in out, out[-3000:]
    print(f"run to its report: {time.monotonic() - started:.0f} s")
