"""Writing a run's overrides into params.yaml: only what changed, in the file's own style."""

from __future__ import annotations

import pytest

from pipelines.params_io import apply_to_params

from conftest import ROOT


def test_a_run_without_overrides_leaves_params_yaml_byte_identical(tmp_path):
    params = tmp_path / "params.yaml"
    original = (ROOT / "params.yaml").read_bytes()
    params.write_bytes(original)
    assert apply_to_params(params, [], []) is False and params.read_bytes() == original
    # An override to the value it already has changes nothing either (same nulls, same list style).
    assert apply_to_params(params, [], ["seed=1234", "grpo.kl_beta=0.04"]) is False
    assert params.read_bytes() == original


def test_an_override_changes_its_own_line_only(tmp_path):
    params = tmp_path / "params.yaml"
    original = (ROOT / "params.yaml").read_text()
    params.write_text(original)
    assert apply_to_params(params, [], ["seed=7"]) is True
    changed = [(a, b) for a, b in zip(original.splitlines(), params.read_text().splitlines()) if a != b]
    assert changed == [("seed: 1234", "seed: 7")] and len(params.read_text().splitlines()) == len(original.splitlines())
    assert "  train_path: null" in params.read_text()  # ruamel's default would write an empty value


@pytest.mark.slow
def test_an_example_run_leaves_the_users_settings_alone(tmp_path):
    """Overrides are for their run: `dvc repro` reproduces that run, the next plain run goes back to the user's
    params.yaml (DVC reusing what it cached for it), and `--persist` is how an override is kept. Real DVC."""
    from conftest import BIN, FAST_PARAMS, copy_project, run

    repo = copy_project(tmp_path / "repo")
    env = {"MLFLOW_TRACKING_URI": f"sqlite:///{repo / 'mlflow.db'}", "PREFECT_HOME": str(tmp_path / "prefect")}
    cli = [str(BIN / "grpo-pipeline"), "run"]
    first = run(cli + ["--persist"] + [x for o in FAST_PARAMS for x in ("--set", o)], repo, env=env)
    assert "params.yaml updated with the run's settings for good (--persist" in first.stdout
    mine = (repo / "params.yaml").read_bytes()  # the user's settings now: the default with FAST_PARAMS
    assert not (repo / ".params.base.yaml").exists()

    example = run(cli + ["--set", "grpo.kl_beta=0.1"], repo, env=env)
    assert "params.yaml holds this run's settings, so `dvc repro` reproduces it" in example.stdout
    assert "kl_beta: 0.1" in (repo / "params.yaml").read_text()
    assert (repo / ".params.base.yaml").read_bytes() == mine
    status = run([str(BIN / "dvc"), "status"], repo, env=env)
    assert "Data and pipelines are up to date." in status.stdout  # dvc repro would reproduce the example run

    plain = run(cli, repo, env=env)
    assert "params.yaml: back to your own settings" in plain.stdout
    assert (repo / "params.yaml").read_bytes() == mine and not (repo / ".params.base.yaml").exists()
    # DVC reuses its cache: the evaluation of these settings' model comes from its run-cache; GRPO, whose
    # checkpoints persist, re-trains (to the same bytes: evaluate's inputs match the cached run's)
    assert "Stage 'evaluate' is cached - skipping run, checking out outputs" in plain.stdout
    again = run(cli, repo, env=env)  # a plain run on the user's settings changes nothing
    assert (repo / "params.yaml").read_bytes() == mine and "params.yaml" not in again.stdout.split("Running stage")[0]
