"""The suite tests the committed project, never the state a user's runs and edits leave in the working tree: after
`make run` (metrics/, models/, data/prepared, plots/, dvc.lock and mlflow.db beside the tracked files), an example's
one-off settings in params.yaml (`make run-smollm2`), a hand edit of it and a workspace `dvc exp run -S`, the tests
read params.yaml as committed (`committed_params`) and copy tracked files only (`copy_committed_project`), and
`make test` runs and passes there. Shown on a real scratch copy of the project holding all of that at once."""

from __future__ import annotations

import re
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

from components.config import PipelineConfig, load_config
from pipelines.params_io import apply_to_params, prepare_params

from conftest import committed_params, committed_text, copy_committed_project, tracked_files

EXAMPLE = "configs/examples/smollm2_addition.yaml"
HAND_EDIT = (re.compile(r"^  steps: \d+", re.M), "  steps: 17")  # grpo.steps, typed into params.yaml
EXPERIMENT = "grpo.kl_beta=0.2"  # what `dvc exp run -S grpo.kl_beta=0.2` in the workspace leaves in params.yaml
# What `make run` leaves beside the tracked files: metrics/*.json are not git-ignored (DVC keeps them in git).
LEFT_BY_A_RUN = ["metrics/validation.json", "metrics/sft.json", "metrics/grpo.json", "dvc.lock", "mlflow.db",
                 "models/base/config.json", "data/prepared/train.jsonl", "plots/grpo_steps.csv", "logs/run.log"]


def leave_a_users_state(repo: Path) -> str:
    """Put into `repo` what the user's work leaves there: an example run's one-off settings in params.yaml (its own
    kept aside, as the next plain run would put back), a hand edit of grpo.steps, a workspace experiment's value and
    a run's outputs. Returns params.yaml as left, asserting each change took."""
    prepare_params(repo, [repo / EXAMPLE], [], False, f"--params {EXAMPLE}")
    params = repo / "params.yaml"
    edited, count = HAND_EDIT[0].subn(HAND_EDIT[1], params.read_text())
    assert count == 1
    params.write_text(edited)
    apply_to_params(params, [], [EXPERIMENT])
    for rel in LEFT_BY_A_RUN:
        (repo / rel).parent.mkdir(parents=True, exist_ok=True)
        (repo / rel).write_text("{}\n")
    left = params.read_text()
    cfg = load_config(params)
    assert (cfg.grpo.steps, cfg.grpo.kl_beta, cfg.sft.enabled) == (17, 0.2, False), "the user's state did not take"
    return left


def _git_status(repo: Path) -> str:
    return subprocess.run(["git", "status", "--porcelain", "--ignored"], cwd=repo, capture_output=True, text=True,
                          check=True).stdout


def test_the_tests_read_params_yaml_as_committed_whatever_the_working_file_holds(tmp_path):
    scratch = copy_committed_project(tmp_path / "scratch")
    committed = (scratch / "params.yaml").read_text()
    left = leave_a_users_state(scratch)
    assert committed_text("params.yaml", scratch) == committed != left
    assert committed_params(scratch).read_text() == committed
    assert asdict(load_config(committed_params(scratch))) == asdict(PipelineConfig())


def test_a_copy_of_the_project_holds_its_tracked_files_as_committed_and_nothing_a_run_left(tmp_path):
    scratch = copy_committed_project(tmp_path / "scratch")
    committed = (scratch / "params.yaml").read_text()
    leave_a_users_state(scratch)
    copy = copy_committed_project(tmp_path / "copy", source=scratch)
    copied = {str(p.relative_to(copy)) for p in copy.rglob("*") if p.is_file() and ".git" not in p.parts}
    assert copied == set(tracked_files(scratch)), sorted(copied ^ set(tracked_files(scratch)))
    assert not any((copy / rel).exists() for rel in LEFT_BY_A_RUN + [".params.base.yaml", ".params.run.json"])
    assert (copy / "params.yaml").read_text() == committed and (copy / "data" / "user").is_dir()


def test_make_test_after_a_run_an_edit_and_an_experiment_passes_and_leaves_them_alone(tmp_path):
    """The checks that read params.yaml (tests/test_config.py) and a test that copies the project and asserts its
    run wrote nothing (the dry run), run by the copy's own suite in the state `leave_a_users_state` leaves: they
    pass, and the state is as they found it; `make own-params` then still puts the user's own settings back."""
    repo = copy_committed_project(tmp_path / "repo")
    (repo / ".venv").symlink_to(sys.prefix)  # this suite's installed stack (the venv, not the Python under it)
    left = leave_a_users_state(repo)
    before = _git_status(repo)

    suite = subprocess.run([sys.executable, "-m", "pytest", "-q", "-n", "0", "-p", "no:cacheprovider",
                            "tests/test_config.py",
                            "tests/pipelines/test_dry_run.py::test_dry_run_writes_nothing_and_reports_one_rollout"],
                           cwd=repo, capture_output=True, text=True, timeout=600)
    assert suite.returncode == 0 and " passed" in suite.stdout, suite.stdout[-3000:] + suite.stderr[-2000:]
    assert (repo / "params.yaml").read_text() == left and _git_status(repo) == before

    back = subprocess.run(["make", "-s", "own-params"], cwd=repo, capture_output=True, text=True, timeout=120)
    assert back.returncode == 0 and "params.yaml: back to your own settings" in back.stdout, back.stdout + back.stderr
    cfg = load_config(repo / "params.yaml")
    assert (cfg.grpo.steps, cfg.grpo.kl_beta, cfg.sft.enabled) == (17, 0.2, True)  # the edits kept, the example gone
