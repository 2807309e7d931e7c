"""Orchestration overhead of the default pipeline: what `make run` spends outside the stages' own compute.

Clones the committed repository into a scratch folder (reusing this checkout's .venv), runs
`make run` there from nothing, and compares its wall time, measured from outside, with the compute
seconds each stage records between the end of its imports and the end of its work
(components/stage_cli.py). The difference is Prefect, MLflow, DVC, process start-up and imports.

    python benchmarks/pipeline_overhead.py            # about 5 minutes on 2 CPU cores
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LINE = re.compile(r"orchestration overhead: ([\d.]+) s of ([\d.]+) s wall .*stages' own compute ([\d.]+) s")


def measure(work: Path) -> dict:
    shutil.rmtree(work, ignore_errors=True)
    work.parent.mkdir(parents=True, exist_ok=True)
    subprocess.run(["git", "clone", "-q", str(ROOT), str(work)], check=True)
    (work / ".venv").symlink_to(ROOT / ".venv")  # this checkout's installed stack, shared
    started = time.perf_counter()
    # `-o .venv/.installed`: the shared .venv is already installed; never reinstall it (that would also
    # point its editable install at the scratch clone). What is timed is the `make run` a user repeats.
    proc = subprocess.run(["make", "-o", ".venv/.installed", "run"], cwd=work, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          env={k: v for k, v in os.environ.items() if k not in ("MLFLOW_TRACKING_URI", "PREFECT_API_URL")})
    wall = time.perf_counter() - started
    (work.parent / "pipeline-make-run.log").write_text(proc.stdout)
    if proc.returncode != 0:
        raise RuntimeError(f"make run failed ({proc.returncode}); see {work.parent / 'pipeline-make-run.log'}")
    match = LINE.search(proc.stdout)
    if match is None:
        raise RuntimeError("make run printed no overhead line")
    compute = float(match.group(3))
    eval_report = json.loads((work / "metrics" / "eval.json").read_text())
    return {"command": "make -o .venv/.installed run (fresh clone, fresh outputs, installed .venv)", "wall_seconds": round(wall, 1),
            "compute_seconds": round(compute, 1), "overhead_seconds": round(wall - compute, 1),
            "overhead_share": round((wall - compute) / wall, 4), "cli_reported_wall_seconds": float(match.group(2)),
            "heldout_before": eval_report["baseline"]["mean_reward"],
            "heldout_after": eval_report["candidate"]["mean_reward"]}


if __name__ == "__main__":
    result = measure(Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT / "benchmarks" / ".work" / "pipeline")
    print(json.dumps(result, indent=2))
    print(f"orchestration overhead of `make run`: {result['overhead_seconds']:.1f} s of {result['wall_seconds']:.1f} s "
          f"= {result['overhead_share']:.1%}")
