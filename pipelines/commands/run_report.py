"""What `grpo-pipeline run` reports at the end: the result against the measured band, and the time spent
outside the stages' own compute."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

from components.config import default_fingerprint

_IMPORTED_AT = time.perf_counter()


def band_report(root: Path, cfg, evaluation: dict) -> str:
    """This run's result next to the band benchmarks/seed_spread.py measured for the default, and a
    plain word when it falls outside (with the likely reasons)."""
    spread = root / "benchmarks" / "results" / "seed_spread.json"
    if not spread.exists():
        return "expected band: none recorded (benchmarks/results/seed_spread.json is missing)"
    measured = json.loads(spread.read_text())
    if measured.get("default_fingerprint") != default_fingerprint(cfg):
        return "expected band: measured for the embedded default only; these params differ from it"
    all_runs = measured["summary"]["all"]
    warm, imp = all_runs["warm_start"], all_runs["improvement"]
    ours_warm, ours_imp = evaluation["baseline"]["mean_reward"], evaluation["improvement"]["mean"]
    lines = [f"expected on the default ({all_runs['runs']} runs: seeds {', '.join(map(str, measured['seeds']))} x "
             f"kernel settings {' and '.join(measured['kernels'])}, on {measured['machine']['cpu']}): warm start "
             f"{warm['min']:.3f} .. {warm['max']:.3f}, improvement {imp['min']:+.3f} .. {imp['max']:+.3f}"]
    outside = [name for name, value, band in (("warm start", ours_warm, warm), ("improvement", ours_imp, imp))
               if not band["min"] <= value <= band["max"]]
    if outside:
        lines.append(f"OUTSIDE the expected band ({' and '.join(outside)}). Likely reasons: another CPU kind or "
                     "kernel path than the runs above (other rounding; see README 'What reproduced means'), another "
                     "thread count, or a changed lock file; the seed alone moved it by less than the band.")
    else:
        lines.append("within the expected band")
    return "\n".join(lines)


def process_age_seconds() -> float:
    """Seconds since this process started (Linux /proc), so the figure includes interpreter start-up;
    without /proc, since this module was imported."""
    try:
        with open("/proc/self/stat") as fh:
            start_ticks = int(fh.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as fh:
            uptime = float(fh.read().split()[0])
        return uptime - start_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return time.perf_counter() - _IMPORTED_AT


def overhead_breakdown(stage_times: list[dict], process_started: float) -> dict[str, float]:
    """Split the overhead by when it happened, from the stages' wall-clock stamps (components/stages/cli.py).

    before first stage: CLI start-up, config checks, Prefect API, MLflow parent run, first DVC check;
    stage warm-ups: each stage's imports and tracking-store connection; between stages: Prefect task
    runs and DVC's hashing and dvc.lock writes; after last stage: reports, artifacts and shutdown.
    """
    stamped = [t for t in stage_times if "entered" in t]
    if not stamped:
        return {}
    now = time.time()
    between = sum(b["entered"] - a["ended_at"] for a, b in zip(stamped, stamped[1:]))
    return {"before_first_stage": round(stamped[0]["entered"] - process_started, 2),
            "stage_warm_ups": round(sum(t["started_at"] - t["entered"] for t in stamped), 2),
            "between_stages": round(between, 2),
            "after_last_stage": round(now - stamped[-1]["ended_at"], 2)}


def report_overhead(result: dict) -> dict[str, float]:
    """Print and log what the run spent outside the stages' own compute (Prefect, MLflow, DVC, start-up)."""
    wall = process_age_seconds()
    compute = sum(t["compute_seconds"] for t in result.get("stage_compute", []))
    figures = {"pipeline.wall_seconds": round(wall, 2), "pipeline.compute_seconds": round(compute, 2),
               "pipeline.overhead_seconds": round(wall - compute, 2),
               "pipeline.overhead_share": round((wall - compute) / wall, 4) if wall > 0 else 0.0}
    print(f"orchestration overhead: {wall - compute:.1f} s of {wall:.1f} s wall "
          f"({figures['pipeline.overhead_share']:.1%}); stages' own compute {compute:.1f} s")
    breakdown = overhead_breakdown(result.get("stage_compute", []), time.time() - wall)
    if breakdown:
        figures.update({f"pipeline.overhead_{k}_seconds": v for k, v in breakdown.items()})
        print("  where: " + ", ".join(f"{k.replace('_', ' ')} {v:.1f} s" for k, v in breakdown.items()))
    try:
        # pipelines.flow imports Prefect, which the run has by now; importing this module (band_report's
        # tests) must not. A failed import is reported like a failed update.
        from pipelines.flow import ParentRun

        ParentRun(result["parent_run_id"], "").update(metrics=figures)
    except Exception as err:  # noqa: BLE001 - a report, never a reason to fail a finished run
        print(f"(overhead figures not logged to MLflow: {err})", file=sys.stderr)
    return figures
