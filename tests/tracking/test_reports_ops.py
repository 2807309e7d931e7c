"""Fast checks of the pictures, the compare table and the retry rule (no servers; those are in
test_operations_servers.py)."""

from __future__ import annotations

import os
import time

import pytest

from components.tracking.registry import RunSummary, compare_table
from components.tracking.reports import _buckets, write_step_figures
from pipelines.retries import backoff_delays, is_transient, retry_transient


def history(n: int) -> list[dict]:
    return [{"step": i, "reward_mean": i / n, "reward_std": 0.1, "loss": 1.0 / i, "kl": 0.01 * i}
            for i in range(1, n + 1)]


def test_step_figures_are_pngs_and_byte_identical_for_the_same_history(tmp_path):
    groups = [(i, [0.0, 0.5, 1.0]) for i in range(1, 13)]
    first = write_step_figures(history(12), groups, tmp_path / "a")
    second = write_step_figures(history(12), groups, tmp_path / "b")
    assert [p.name for p in first] == ["grpo_reward.png", "grpo_training.png", "grpo_group_rewards.png",
                                       "grpo_heldout.png"]
    for a, b in zip(first, second):  # DVC records their hashes: the same run must give the same files
        assert a.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and a.read_bytes() == b.read_bytes()
    other = write_step_figures(history(11), groups, tmp_path / "c")
    assert other[0].read_bytes() != first[0].read_bytes()


def test_group_buckets_pool_consecutive_steps():
    groups = [(1, [0.0, 1.0]), (2, [0.5]), (3, [0.25]), (4, [1.0]), (5, [0.75])]
    assert _buckets(groups, 2) == [("1-3", [0.0, 1.0, 0.5, 0.25]), ("4-5", [1.0, 0.75])]
    assert _buckets(groups, 10)[0] == ("1", [0.0, 1.0])
    assert _buckets([], 3) == []


def test_compare_table_lists_only_differing_params():
    runs = [RunSummary("a" * 32, "pipeline", "FINISHED", {"grpo.kl_beta": "0.04", "seed": "1"},
                       {"baseline_mean_reward": 0.5, "candidate_mean_reward": 0.625, "improvement_mean": 0.125,
                        "improvement_ci95_low": 0.05, "improvement_ci95_high": 0.2},
                       {"data.heldout.md5": "f" * 32, "promotion.decision": "champion",
                        "promotion.champion_version": "none"}, 61.25),
            RunSummary("b" * 32, "pipeline", "FINISHED", {"grpo.kl_beta": "0.08", "seed": "1"},
                       {"candidate_mean_reward": 0.6, "vs_champion_mean": -0.025, "vs_champion_ci95_low": -0.07,
                        "vs_champion_ci95_high": 0.02},
                       {"data.heldout.md5": "f" * 32, "promotion.decision": "challenger",
                        "promotion.champion_version": "1"}, None)]
    table = compare_table(runs)
    assert "param grpo.kl_beta" in table and "param seed" not in table
    lines = {line.split("  ")[0].strip(): line for line in table.splitlines()}
    assert "0.6250" in table and "+0.1250 (+0.0500 .. +0.2000)" in lines["vs its start (95% CI)"]
    # the champion comparison beside the comparison with the run's own start
    assert lines["vs champion (95% CI)"].split()[4:] == ["none", "yet", "-0.0250", "(-0.0700", "..", "+0.0200)"]
    assert lines["promotion"].split()[1:] == ["champion", "challenger"]
    assert "61.2s" in table or "61.3s" in table
    assert lines["data.heldout.md5"].count("ffffffffffff") == 2


def unreachable_mlflow_error() -> Exception:
    """The exception MLflow's client really raises when its tracking server is down."""
    from mlflow.tracking import MlflowClient

    os.environ["MLFLOW_HTTP_REQUEST_MAX_RETRIES"] = "0"
    try:
        MlflowClient(tracking_uri="http://127.0.0.1:9").get_experiment_by_name("x")  # port 9: nothing listens
    except Exception as err:  # noqa: BLE001
        return err
    finally:
        os.environ.pop("MLFLOW_HTTP_REQUEST_MAX_RETRIES", None)
    raise AssertionError("expected a connection error")


def test_only_an_outage_the_stage_reported_is_retried_never_words_in_a_failure():
    """A failure is retried only when it carries the outage field a stage sets where MLflow's client failed; a user
    environment's `ConnectionError` (or any words about connections) fails after one attempt."""
    from pipelines.flow import StageError

    outage = {"server": "MLflow tracking server", "address": "http://127.0.0.1:9"}
    assert is_transient(StageError("register: the MLflow tracking server at http://127.0.0.1:9 did not answer",
                                   outage=outage))
    users = StageError("grpo: shopcat.games:make: reset raised ConnectionError: game server unreachable (Connection "
                       "refused; Max retries exceeded; 503 Service Unavailable) (record 'r1')")
    assert not is_transient(users)
    assert not is_transient(unreachable_mlflow_error())  # in the flow process, no stage said it: no field
    validation = StageError("stage 'validate' failed (exit 1):\nvalidation failed, 1 rule(s) broken; nothing was "
                            "trained:\n  - data/user/train.jsonl: rule 'unique ids' failed for ids [a, a]")
    assert not is_transient(validation)
    assert backoff_delays(10, 3) == [10, 30, 90]


def test_a_connection_failure_is_the_pipelines_outage_only_where_the_pipeline_talks_to_its_server():
    """Known by where it was raised: inside MLflow's client (or the project's tracking code) it is an outage; the same
    type raised by the user's code, or by MLflow called from the user's code (through the door every call of the
    user's code takes), is the user's failure."""
    from components.tracking.outbox import TrackingUnreachable, is_outage, tracking_outage
    from components.user_code import UserCodeError, calling

    assert tracking_outage(unreachable_mlflow_error())

    def reset(record):  # a user's environment whose game server is down
        raise ConnectionError("game server unreachable")

    try:
        reset({})
    except ConnectionError as err:
        raw = err
    assert is_outage(raw) and not tracking_outage(raw)
    with pytest.raises(UserCodeError) as wrapped, calling("environment 'shopcat.games:make'", "starting an episode"):
        from mlflow.tracking import MlflowClient

        os.environ["MLFLOW_HTTP_REQUEST_MAX_RETRIES"] = "0"
        MlflowClient(tracking_uri="http://127.0.0.1:9").get_experiment_by_name("x")
    os.environ.pop("MLFLOW_HTTP_REQUEST_MAX_RETRIES", None)
    assert is_outage(wrapped.value) and not tracking_outage(wrapped.value)
    assert tracking_outage(TrackingUnreachable("the tracking server did not answer the start-up check"))


def test_a_retry_is_said_in_one_line_naming_the_server_and_when_the_stage_runs_again(tmp_path, monkeypatch, capsys):
    """The stage's report (as the flow reads it back) carries the outage; Prefect's retry rule retries it and says in
    one line which server did not answer and when the stage runs again; a report without the field is not retried
    and says nothing."""
    pytest.importorskip("prefect")
    from prefect.client.schemas.objects import TaskRun
    from prefect.states import Failed

    from components.stages.cli import ERROR_FILE_ENV, read_report, report_error
    from pipelines.flow import StageError, run_stage
    from pipelines.retries import retry_line

    report = tmp_path / "report.txt"
    monkeypatch.setenv(ERROR_FILE_ENV, str(report))
    report_error("the MLflow tracking server at http://127.0.0.1:9 did not answer after bounded retries",
                 outage={"server": "MLflow tracking server", "address": "http://127.0.0.1:9"})
    message, outage = read_report(str(report))
    task = run_stage.with_options(name="stage-register", retries=2, retry_delay_seconds=[10.0, 30.0])
    first = TaskRun(task_key="stage", dynamic_key="0", run_count=1)
    assert retry_transient(task, first, Failed(data=StageError(f"register: {message}", outage=outage)))
    said = capsys.readouterr().err.splitlines()
    assert len(said) == 1 and said[0].startswith("register: the MLflow tracking server at http://127.0.0.1:9 did not "
                                                 "answer; the stage runs again in 10 s (at ")
    assert said[0].endswith("; retry 1 of 2)")
    assert retry_line("grpo", outage, 2, 2, 30.0, now=0.0).endswith("runs again in 30 s (at "
                                                                     f"{time.strftime('%H:%M:%S', time.localtime(30))}"
                                                                     "; retry 2 of 2)")
    report_error("shopcat.games:make: reset raised ConnectionError: game server unreachable")
    message, outage = read_report(str(report))
    assert outage is None
    assert not retry_transient(task, first, Failed(data=StageError(f"grpo: {message}", outage=outage)))
    assert capsys.readouterr().err == ""


def test_compare_accepts_the_short_run_ids_it_prints(mlflow_store):
    from mlflow.tracking import MlflowClient

    from components.tracking.registry import RegistryRefused, pipeline_runs

    client = MlflowClient(mlflow_store)
    experiment = client.create_experiment("short-ids")
    ids = [client.create_run(experiment, tags={"grpo.stage": "pipeline"}).info.run_id for _ in range(2)]
    runs = pipeline_runs(client, "short-ids", [ids[0][:12], ids[1]])  # what the table prints, and a full id
    assert [r.run_id for r in runs] == ids
    with pytest.raises(RegistryRefused, match="matches 0 runs in experiment 'short-ids'"):
        pipeline_runs(client, "short-ids", ["ffffffffffff" if not ids[0].startswith("f") else "000000000000"])


def test_a_command_outside_the_repository_says_how_to_point_at_it(tmp_path, capsys):
    from pipelines.cli import main

    assert main(["compare", "--root", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "is not a grpo-pipeline repository (no params.yaml there)" in err and "--root" in err
    assert "Traceback" not in err


def test_a_failed_stage_is_one_line_in_prefects_console_log():
    import io
    import logging

    from pipelines.flow import OneLineStageErrors, StageError

    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.addFilter(OneLineStageErrors())
    logger = logging.getLogger("test.one-line")
    logger.addHandler(handler)
    try:
        raise StageError("validate: validation failed, 1 rule(s) broken; nothing was trained:\n  - rule 'x'",
                         detail="the stage's last lines")
    except StageError as err:
        logger.error("Task run failed with exception: %r - Retries are exhausted", err, exc_info=True)
        logger.error("Finished in state Failed('Task run encountered an exception StageError: %s')", err)
    finally:
        logger.removeHandler(handler)
    lines = stream.getvalue().splitlines()
    assert lines == ["Task run failed with exception: validate: validation failed, 1 rule(s) broken; nothing was "
                     "trained:", "Finished in state Failed('Task run encountered an exception (a stage failed; its "
                     "report is printed at the end)"], lines
    assert "Traceback" not in stream.getvalue() and "rule 'x'" not in stream.getvalue()
