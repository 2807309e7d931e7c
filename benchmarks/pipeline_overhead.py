"""Orchestration overhead of the default pipeline: what `make run` spends outside the stages' own compute.

Clones the committed repository into a scratch folder (reusing this checkout's .venv), runs
`make run` there from nothing, and compares its wall time, measured from outside, with the compute
seconds each stage records between the end of its imports and the end of its work
(components/stages/cli.py). The difference is Prefect, MLflow, DVC, process start-up and imports.

The start-up is CPU-bound on two cores, so the share moves with whatever else the shared machine
runs. As for the engine speed-ups, the figure
reported is the median of several runs, each a fresh clone; every run is kept in the report.

    python benchmarks/pipeline_overhead.py [WORKDIR] [--runs N]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LINE = re.compile(r"orchestration overhead: ([\d.]+) s of ([\d.]+) s wall .*stages' own compute ([\d.]+) s")


def fresh_clone(work: Path) -> dict[str, str]:
    """A clone of the committed repository at `work` (replacing any), sharing this checkout's installed
    .venv; returns the environment to run it in: this one without a tracking or Prefect server, so each
    clone's pipeline uses its own stores."""
    shutil.rmtree(work, ignore_errors=True)
    work.parent.mkdir(parents=True, exist_ok=True)
    subprocess.run(["git", "clone", "-q", str(ROOT), str(work)], check=True)
    (work / ".venv").symlink_to(ROOT / ".venv")
    return {k: v for k, v in os.environ.items() if k not in ("MLFLOW_TRACKING_URI", "PREFECT_API_URL")}


def pipeline_run(work: Path, args: list[str], log: Path, fresh: bool = True) -> float:
    """`grpo-pipeline run ARGS` in a clone at `work` (a fresh one unless `fresh` is false; this checkout's .venv,
    telemetry off): its wall seconds. The output goes to `log`; a failed run raises, naming the log."""
    return pipeline_run_measured(work, args, log, fresh)[0]


def pipeline_run_measured(work: Path, args: list[str], log: Path, fresh: bool = True) -> tuple[float, int]:
    """`pipeline_run`, also returning the peak of the summed resident memory of the run's processes (bytes)."""
    from benchmarks.quick_start import timed
    from components.quiet import QUIET_DEFAULTS

    if fresh:
        fresh_clone(work)
    env = {**{k: v for k, v in os.environ.items() if k not in ("MLFLOW_TRACKING_URI", "PREFECT_API_URL")},
           **QUIET_DEFAULTS}
    env["PATH"] = f"{ROOT / '.venv' / 'bin'}:{env.get('PATH', '')}"
    wall, _, samples = timed(["grpo-pipeline", "run", *args], work, env, log)
    return wall, samples.peak


def measure(work: Path) -> dict:
    env = fresh_clone(work)
    started = time.perf_counter()
    # `-o`: the shared .venv is already installed and compiled; never reinstall it (that would also point its
    # editable install at the scratch clone). What is timed is the `make run` a user repeats.
    proc = subprocess.run(["make", "-o", ".venv/.installed", "-o", ".venv/.compiled", "run"], cwd=work,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    wall = time.perf_counter() - started
    (work.parent / "pipeline-make-run.log").write_text(proc.stdout)
    if proc.returncode != 0:
        raise RuntimeError(f"make run failed ({proc.returncode}); see {work.parent / 'pipeline-make-run.log'}")
    match = LINE.search(proc.stdout)
    if match is None:
        raise RuntimeError("make run printed no overhead line")
    compute = float(match.group(3))
    eval_report = json.loads((work / "metrics" / "eval.json").read_text())
    return {"command": "make -o .venv/.installed -o .venv/.compiled run (fresh clone, fresh outputs, installed .venv)",
            "wall_seconds": round(wall, 1),
            "compute_seconds": round(compute, 1), "overhead_seconds": round(wall - compute, 1),
            "overhead_share": round((wall - compute) / wall, 4), "cli_reported_wall_seconds": float(match.group(2)),
            "heldout_before": eval_report["baseline"]["mean_reward"],
            "heldout_after": eval_report["candidate"]["mean_reward"]}


def measure_runs(work: Path, runs: int = 3) -> dict:
    """`measure` `runs` times, one fresh clone each: the run with the median overhead share (the lower
    of the two middle runs for an even count, so the figure is always one that was measured), plus all."""
    if runs < 1:
        raise ValueError("runs must be at least 1")
    results = []
    for i in range(runs):
        results.append(measure(work))
        print(f"  make run {i + 1}/{runs}: overhead {results[-1]['overhead_seconds']:.1f} s of "
              f"{results[-1]['wall_seconds']:.1f} s = {results[-1]['overhead_share']:.1%}", flush=True)
    median_share = statistics.median_low(r["overhead_share"] for r in results)
    median_run = next(r for r in results if r["overhead_share"] == median_share)
    statistic = "one run" if runs == 1 else f"median of {runs} runs" if runs % 2 else f"lower median of {runs} runs"
    return {**median_run, "statistic": statistic,
            "runs": [{k: r[k] for k in ("wall_seconds", "compute_seconds", "overhead_seconds", "overhead_share")}
                     for r in results]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("work", nargs="?", default=str(ROOT / "benchmarks" / ".work" / "pipeline"))
    parser.add_argument("--runs", type=int, default=3, help="make runs, one fresh clone each (median reported)")
    args = parser.parse_args(argv)
    result = measure_runs(Path(args.work), args.runs)
    print(json.dumps(result, indent=2))
    print(f"orchestration overhead of `make run` ({result['statistic']}): {result['overhead_seconds']:.1f} s of "
          f"{result['wall_seconds']:.1f} s = {result['overhead_share']:.1%} (runs: "
          + ", ".join(f"{r['overhead_share']:.1%}" for r in result["runs"]) + ")")
    return 0


if __name__ == "__main__":
    sys.exit(main())
