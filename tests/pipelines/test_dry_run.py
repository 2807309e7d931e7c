"""`grpo-pipeline run --dry-run`: validates and runs one rollout + one loss, writes nothing."""

import re

from conftest import BIN, copy_project, run


def test_dry_run_writes_nothing_and_reports_one_rollout(tmp_path):
    repo = copy_project(tmp_path / "repo")
    before = (repo / "params.yaml").read_text()
    proc = run([str(BIN / "grpo-pipeline"), "run", "--dry-run", "--set", "grpo.prompts_per_step=4",
                "--set", "task.n_train=100", "--set", "task.n_sft=50", "--set", "task.n_heldout=50"], repo)
    assert re.search(r"one rollout of 32 completions, reward mean \d\.\d{3}, loss [+-]\d\.\d{4}", proc.stdout)
    assert (repo / "params.yaml").read_text() == before
    for produced in ("data/prepared", "models", "metrics", "mlflow.db", "dvc.lock"):
        assert not (repo / produced).exists(), produced


def test_dry_run_refuses_bad_config_naming_the_key(tmp_path):
    repo = copy_project(tmp_path / "repo")
    proc = run([str(BIN / "grpo-pipeline"), "run", "--dry-run", "--set", "grpo.group_size=1"], repo, check=False)
    assert proc.returncode == 2 and "error: grpo.group_size: must be >= 2" in proc.stdout
