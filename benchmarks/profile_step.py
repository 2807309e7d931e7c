"""Where a GRPO step's seconds go, for one benchmark row: generation, reward, reference, policy forward,
backward, optimizer, and the operators with the most self CPU time.

Runs the real grpo stage from the row's start (benchmarks/grpo_vs_trl.py builds it, once) for
`--warmup` + `--steps` steps. Phase seconds are the stage's own step timings (`time/...` metrics, no
profiler running), the median over the measured steps; then torch.profiler records `--profile-steps`
more steps for the top operators. Each invocation stores its figures under `--label` (e.g. `before`,
`after`) with the commit, so one table shows a change's effect side by side.

    python benchmarks/profile_step.py --row smollm2-lora --label after     # about 3 minutes on 2 CPU cores
    python benchmarks/profile_step.py --row tiny --label after --set grpo.prefix_sharing=false
    python benchmarks/profile_step.py --row smollm2-long --shapes 12   # also the heaviest (operator, input shapes)

Writes benchmarks/results/profile_step.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

PHASES = {"generation": "time/generation", "reward": "time/reward", "reference": "time/reference",
          "policy forward": "time/policy_forward", "policy backward": "time/policy_backward",
          "optimizer": "time/optimizer"}


def profile_row(row_name: str, overrides: list[str], threads: int, warmup: int, steps: int, profile_steps: int,
                top: int, shapes: int = 0) -> dict[str, Any]:
    import torch
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    from benchmarks.grpo_vs_trl import (
        BENCH_OVERRIDES,
        ROWS,
        grpo_run_dir,
        peak_rss_mb,
        prepare_start,
        reset_peak_rss,
        row_config,
    )
    from components.data.paths import Paths
    from components.stages.grpo import train_grpo

    row = ROWS[row_name]
    work = ROOT / "benchmarks" / ".work"
    root = prepare_start(row, work, threads)
    os.environ["MLFLOW_TRACKING_URI"] = f"sqlite:///{work / 'mlflow.db'}"
    total = warmup + steps + profile_steps
    cfg = row_config(row, BENCH_OVERRIDES + [f"threads={threads}", f"grpo.steps={total}", f"grpo.log_every={total}",
                                             *overrides])
    rows: list[dict[str, float]] = []
    state: dict[str, Any] = {}

    def on_step(step: int, _model, metrics: dict[str, float]) -> None:
        if step == warmup:
            reset_peak_rss()  # the measured steps' peak, apart from start-up's
        if warmup < step <= warmup + steps:
            rows.append(metrics)
        if step == warmup + steps:
            state["peak_rss_mb"] = peak_rss_mb()
            state["profiler"] = torch_profile(activities=[ProfilerActivity.CPU], record_shapes=shapes > 0)
            state["profiler"].__enter__()
        elif step == total:
            state["profiler"].__exit__(None, None, None)

    train_grpo(cfg, Paths(root=grpo_run_dir(root, f"profile-{row_name}")), callbacks=[on_step])
    phases = {name: statistics.median(r[key] for r in rows) for name, key in PHASES.items()}
    step_seconds = statistics.median(r["step_seconds"] for r in rows)
    phases["other (entropy, logging, Python)"] = max(0.0, step_seconds - sum(phases.values()))
    table = state["profiler"].key_averages()
    busy = sum(e.self_cpu_time_total for e in table)
    hot = sorted(table, key=lambda e: e.self_cpu_time_total, reverse=True)[:top]
    def figures(e: Any) -> dict[str, Any]:  # one profiler row, per measured step
        return {"op": e.key, "self_cpu_s_per_step": round(e.self_cpu_time_total / 1e6 / profile_steps, 4),
                "share": round(e.self_cpu_time_total / busy, 3), "calls_per_step": e.count // profile_steps}

    by_shape = sorted(state["profiler"].key_averages(group_by_input_shape=True) if shapes else [],
                      key=lambda e: e.self_cpu_time_total, reverse=True)[:shapes]
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", ".", ":!benchmarks/results"],
                           cwd=ROOT, capture_output=True, text=True).stdout.strip()
    return {"commit": commit.strip() + ("+changes" if dirty else ""), "overrides": overrides, "threads": threads,
            "machine": f"{platform.machine()}, {os.cpu_count()} CPUs ({torch.backends.cpu.get_cpu_capability()}), "
                       f"torch {torch.__version__}",
            "measured_steps": steps, "step_seconds": round(step_seconds, 4),
            "completions_per_s": round(statistics.median(r["completions_per_s"] for r in rows), 2),
            "peak_rss_mb": round(state["peak_rss_mb"]),
            "phases_seconds": {k: round(v, 4) for k, v in phases.items()},
            "top_ops": [figures(e) for e in hot],
            **({"top_shapes": [{**figures(e), "shapes": str(e.input_shapes)} for e in by_shape]} if shapes else {})}


def seconds(value: float) -> str:
    """Three significant digits at least (the tiny model's phases are milliseconds)."""
    return f"{value:.4f}" if value < 0.1 else f"{value:.3f}"


def markdown(results: dict[str, dict[str, Any]]) -> str:
    lines = ["# Where a GRPO step's seconds go", "",
             "`python benchmarks/profile_step.py --row ROW --label LABEL`; phase seconds are medians over the "
             "measured steps (no profiler running); operators are self CPU time from torch.profiler.", ""]
    for row, labels in results.items():
        names = list(labels)
        lines += [f"## {row}", "", "| | " + " | ".join(f"{n} ({labels[n]['commit']})" for n in names) + " |",
                  "|---|" + "---|" * len(names),
                  "| s/step (median) | " + " | ".join(f"**{seconds(labels[n]['step_seconds'])}**" for n in names)
                  + " |",
                  "| completions/s | " + " | ".join(f"{labels[n]['completions_per_s']:.1f}" for n in names) + " |",
                  "| peak RSS, measured steps | " + " | ".join(f"{labels[n]['peak_rss_mb']} MB" if "peak_rss_mb" in
                                                           labels[n] else "-" for n in names) + " |"]
        phases = list(dict.fromkeys(p for n in names for p in labels[n]["phases_seconds"]))
        for phase in phases:
            cells = []
            for n in names:
                value = labels[n]["phases_seconds"].get(phase)
                share = value / labels[n]["step_seconds"] if value is not None else None
                cells.append("-" if value is None else f"{seconds(value)} s ({share:.0%})")
            lines.append(f"| {phase} | " + " | ".join(cells) + " |")
        depth = max(len(labels[n]["top_ops"]) for n in names)
        for i in range(depth):
            cells = []
            for n in names:
                ops = labels[n]["top_ops"]
                cells.append(f"`{ops[i]['op']}` {seconds(ops[i]['self_cpu_s_per_step'])} s ({ops[i]['share']:.0%}, "
                             f"{ops[i]['calls_per_step']} calls)" if i < len(ops) else "")
            lines.append(f"| operator {i + 1} | " + " | ".join(cells) + " |")
        for n in names:
            if labels[n].get("top_shapes"):
                lines += ["", f"Heaviest operator calls by input shapes, {n}:", "",
                          "| operator | input shapes | s/step | share | calls/step |", "|---|---|---|---|---|"]
                lines += [f"| `{e['op']}` | `{e['shapes']}` | {seconds(e['self_cpu_s_per_step'])} | {e['share']:.0%} | "
                          f"{e['calls_per_step']} |" for e in labels[n]["top_shapes"]]
        overrides = {n: labels[n]["overrides"] for n in names if labels[n]["overrides"]}
        lines += ["", f"Machine: {labels[names[-1]]['machine']}, {labels[names[-1]]['threads']} threads."
                  + (f" Overrides: {overrides}." if overrides else ""), ""]
    return "\n".join(lines)


def main() -> int:
    from benchmarks.grpo_vs_trl import ROWS

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--row", default="smollm2-lora", choices=list(ROWS))
    parser.add_argument("--label", default="current", help="the column these figures go to (e.g. before, after)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], help="a key=value override")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5, help="steps whose phase timings are measured")
    parser.add_argument("--profile-steps", type=int, default=2, help="steps recorded by torch.profiler")
    parser.add_argument("--top", type=int, default=8, help="operators listed")
    parser.add_argument("--shapes", type=int, default=0, help="also list the N heaviest (operator, input shapes)")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = parser.parse_args()
    for key, value in {"HF_HUB_OFFLINE": "1", "MLFLOW_DISABLE_TELEMETRY": "true", "TOKENIZERS_PARALLELISM": "false",
                       "DVC_NO_ANALYTICS": "1", "GX_ANALYTICS_ENABLED": "false"}.items():
        os.environ.setdefault(key, value)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    json_path = out / "profile_step.json"
    results = json.loads(json_path.read_text()) if json_path.exists() else {}
    if not isinstance(results, dict) or "top5" in json.dumps(results)[:200]:  # the old single-row format
        results = {}
    figures = profile_row(args.row, args.overrides, args.threads, args.warmup, args.steps, args.profile_steps, args.top,
                          args.shapes)
    results.setdefault(args.row, {})[args.label] = figures
    json_path.write_text(json.dumps(results, indent=2) + "\n")
    text = markdown(results)
    (out / "profile_step.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
