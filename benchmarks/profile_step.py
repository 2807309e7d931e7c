"""Where a GRPO step's time goes, before and after the prompt-once forward: torch.profiler top-5 hot spots.

Runs the real grpo stage for a few steps from the benchmark's tiny warm start (built by
benchmarks/grpo_vs_trl.py, or by this script when missing) with `grpo.prefix_sharing` off (the plain
Hugging Face forward, "before") and on ("after"), profiling the steps after a short warm-up, and
prints CPU time per step and the five operators with the most self CPU time.

    python benchmarks/profile_step.py            # about a minute on 2 CPU cores
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def profile(prefix_sharing: bool, root: Path, steps: int, warmup: int) -> dict:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    from benchmarks.grpo_vs_trl import grpo_run_dir
    from components.config import load_config
    from components.data.paths import Paths
    from components.stages.grpo import train_grpo

    run_dir = grpo_run_dir(root, f"profile-{'after' if prefix_sharing else 'before'}")
    cfg = load_config(ROOT / "params.yaml", [f"grpo.steps={warmup + steps}", "grpo.checkpoint_every=0",
                                             f"grpo.log_every={warmup + steps}",
                                             f"grpo.prefix_sharing={str(prefix_sharing).lower()}"])
    state: dict = {}

    def on_step(step: int, _model, _metrics) -> None:
        if step == warmup:
            state["profiler"] = torch_profile(activities=[ProfilerActivity.CPU])
            state["profiler"].__enter__()
            state["cpu"] = time.process_time()
        elif step == warmup + steps:
            state["cpu"] = time.process_time() - state["cpu"]
            state["profiler"].__exit__(None, None, None)

    train_grpo(cfg, Paths(root=run_dir), callbacks=[on_step])
    table = state["profiler"].key_averages()
    total = sum(e.self_cpu_time_total for e in table)
    top = sorted(table, key=lambda e: e.self_cpu_time_total, reverse=True)[:5]
    return {"prefix_sharing": prefix_sharing, "cpu_seconds_per_step": round(state["cpu"] / steps, 4),
            "top5": [{"op": e.key, "self_cpu_ms_per_step": round(e.self_cpu_time_total / 1000 / steps, 2),
                      "share": round(e.self_cpu_time_total / total, 3), "calls_per_step": e.count // steps}
                     for e in top]}


def main() -> int:
    for key, value in {"HF_HUB_OFFLINE": "1", "MLFLOW_DISABLE_TELEMETRY": "true"}.items():
        os.environ.setdefault(key, value)
    from benchmarks.grpo_vs_trl import prepare_start

    work = ROOT / "benchmarks" / ".work"
    root = prepare_start("tiny", work, threads=2)
    os.environ["MLFLOW_TRACKING_URI"] = f"sqlite:///{work / 'mlflow.db'}"
    results = [profile(False, root, steps=30, warmup=5), profile(True, root, steps=30, warmup=5)]
    lines = ["| | before (plain HF forward) | after (prompt-once forward) |", "|---|---|---|",
             f"| CPU seconds per step | {results[0]['cpu_seconds_per_step']:.4f} | "
             f"{results[1]['cpu_seconds_per_step']:.4f} |"]
    for i in range(5):
        cells = [f"`{r['top5'][i]['op']}` {r['top5'][i]['self_cpu_ms_per_step']:.1f} ms ({r['top5'][i]['share']:.0%})"
                 for r in results]
        lines.append(f"| hot spot {i + 1} | {cells[0]} | {cells[1]} |")
    text = "\n".join(lines) + "\n"
    out = ROOT / "benchmarks" / "results"
    (out / "profile_step.json").write_text(json.dumps(results, indent=2) + "\n")
    (out / "profile_step.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
