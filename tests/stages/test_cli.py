"""The stages' shared entry (components/stages/cli.py)."""

from __future__ import annotations

import os
import subprocess
import sys

from conftest import ROOT, committed_params

WARM_UP = """
import sys
from components.config import load_config
from components.stages.cli import _warm_up
assert "mlflow" not in sys.modules
_warm_up(load_config({params!r}), "grpo")
print(sorted(m for m in ("mlflow", "torch", "transformers") if m in sys.modules))
"""


def test_a_rank_other_than_0_warms_up_without_mlflow_or_the_tracking_store(tmp_path):
    """Ranks > 0 of a distributed stage track nothing: their warm-up imports what the stage computes with, not MLflow,
    and never connects to the tracking store (connecting imports MLflow)."""
    env = {**os.environ, "RANK": "1", "PYTHONPATH": str(ROOT),
           "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path / 'mlflow.db'}"}
    proc = subprocess.run([sys.executable, "-c", WARM_UP.format(params=str(committed_params()))], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split("\n")[-2] == "['torch', 'transformers']", proc.stdout
    assert not (tmp_path / "mlflow.db").exists()
