"""Fast checks of the pictures, the compare table and the retry rule (no servers; those are in
test_operations_servers.py)."""

from __future__ import annotations

import os

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


def test_transient_failures_are_retried_deterministic_ones_never():
    from pipelines.flow import StageError

    down = unreachable_mlflow_error()
    assert is_transient(down)
    assert is_transient(StageError(f"stage 'register' failed (exit 1):\n{type(down).__name__}: {down}"))
    assert is_transient(ConnectionRefusedError(111, "Connection refused"))
    validation = StageError("stage 'validate' failed (exit 1):\nvalidation failed, 1 rule(s) broken; nothing was "
                            "trained:\n  - data/user/train.jsonl: rule 'unique ids' failed for ids [a, a]")
    assert not is_transient(validation)
    assert not is_transient(StageError("stage 'grpo' failed (exit 1):\nRuntimeError: shapes do not match"))
    assert backoff_delays(10, 3) == [10, 30, 90]


def test_retry_condition_reads_the_failed_prefect_state():
    pytest.importorskip("prefect")
    from prefect.states import Failed

    from pipelines.flow import StageError

    assert retry_transient(None, None, Failed(data=StageError("HTTPConnectionPool: Max retries exceeded")))
    assert not retry_transient(None, None, Failed(data=StageError("validation failed, 2 rule(s) broken")))


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
