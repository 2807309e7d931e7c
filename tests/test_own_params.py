"""`make test` after an example run (`make run-smollm2`: the example's settings stay in params.yaml until the next
plain run): the suite stops before any test in one line naming `make own-params`, which puts the user's own
settings back without running anything; then the tests run. A real copy of the project, its own test suite, make."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from conftest import copy_project

EXAMPLE = "configs/examples/smollm2_addition.yaml"


def test_make_test_after_an_example_run_names_make_own_params_and_runs_after_it(tmp_path):
    from pipelines.params_io import prepare_params

    repo = copy_project(tmp_path / "repo")
    (repo / ".venv").symlink_to(Path(sys.executable).resolve().parent.parent)  # this suite's installed stack
    mine = (repo / "params.yaml").read_text()
    prepare_params(repo, [repo / EXAMPLE], [], False, f"--params {EXAMPLE}")  # what `make run-smollm2` leaves
    assert (repo / "params.yaml").read_text() != mine

    def suite() -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                               "tests/test_config.py"], cwd=repo, capture_output=True, text=True, timeout=600)

    stopped = suite()
    said = [line for line in stopped.stdout.splitlines() + stopped.stderr.splitlines() if "own-params" in line]
    assert stopped.returncode == 4 and " passed" not in stopped.stdout, stopped.stdout + stopped.stderr
    assert len(said) == 1 and f"one-off settings (--params {EXAMPLE})" in said[0], said

    back = subprocess.run(["make", "-s", "own-params"], cwd=repo, capture_output=True, text=True, timeout=120)
    assert back.returncode == 0 and "params.yaml: back to your own settings" in back.stdout, back.stdout + back.stderr
    assert (repo / "params.yaml").read_text() == mine
    ran = suite()
    assert ran.returncode == 0 and " passed" in ran.stdout, ran.stdout[-3000:]
