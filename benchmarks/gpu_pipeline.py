"""The pipeline's run on a GPU, recorded: what `benchmarks/device/pipeline_call2.sh` left in its output folder turned
into benchmarks/results/gpu_pipeline.{json,md}.

It reads the run's own records, nothing re-measured: its exit status and wall time, each stage's seconds (the flow's
"stage NAME ran in S s" lines), held-out reward before and after GRPO with the paired bootstrap's 95% CI
(metrics/eval.json), the grpo stage's completion tokens a second (plots/grpo_steps.csv: completions a second times the
mean completion length, the median over the steps after the first), the peak GPU memory in use (nvidia-smi's samples
through the run, every process on the card), the served model's answer, the card and the exact package versions.

    python benchmarks/gpu_pipeline.py --from CALL_OUTPUT_FOLDER
"""

from __future__ import annotations

import argparse
import csv
import json
import re
import statistics
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
VERSIONS = ("torch", "transformers", "peft", "prefect", "mlflow", "dvc", "great_expectations")


def stage_seconds(log: str) -> dict[str, float]:
    """Seconds of each stage that ran, in the flow's order (a stage DVC skipped is left out)."""
    return {name: float(s) for name, s in re.findall(r"stage (\w+) ran in ([\d.]+)s", log)}


def completion_tokens_per_s(steps_csv: Path) -> float | None:
    """Median over the steps after the first of completions a second times their mean length."""
    rows = list(csv.DictReader(steps_csv.open()))[1:]
    rates = [float(r["completions_per_s"]) * float(r["completion_length"]) for r in rows
             if r.get("completions_per_s") and r.get("completion_length")]
    return round(statistics.median(rates), 1) if rates else None


def peak_gpu_gib(samples: Path) -> float | None:
    values = [float(line) for line in samples.read_text().split() if re.fullmatch(r"[\d.]+", line)]
    return round(max(values) / 1024, 2) if values else None


def record(out: Path) -> dict[str, Any]:
    """The run in `out` (a call's output folder) as the results file's record."""
    status = json.loads((out / "pipeline_status.json").read_text())
    found: dict[str, Any] = {"exit_status": status["exit_status"], "wall_s": status["wall_s"],
                             "card": (out / "card.txt").read_text().strip() if (out / "card.txt").exists() else None,
                             "stage_seconds": stage_seconds((out / "pipeline.txt").read_text())}
    if (out / "metrics" / "eval.json").exists():
        ev = json.loads((out / "metrics" / "eval.json").read_text())
        found["heldout"] = {"n": ev["n"], "before": ev["baseline"]["mean_reward"],
                            "after": ev["candidate"]["mean_reward"], "improvement": ev["improvement"]["mean"],
                            "improvement_ci95_low": ev["improvement"]["ci95_low"],
                            "improvement_ci95_high": ev["improvement"]["ci95_high"]}
    steps = out / "plots" / "grpo_steps.csv"
    found["grpo_completion_tokens_per_s"] = completion_tokens_per_s(steps) if steps.exists() else None
    memory = out / "gpu_memory_mib.txt"
    found["peak_gpu_memory_in_use_gib"] = peak_gpu_gib(memory) if memory.exists() else None
    if (out / "served.json").exists() and (out / "served.json").read_text().strip():
        found["served"] = json.loads((out / "served.json").read_text())
    if (out / "packages.json").exists():
        installed = {p["name"].lower().replace("-", "_"): p["version"]
                     for p in json.loads((out / "packages.json").read_text())}
        found["versions"] = {name: installed.get(name) for name in VERSIONS}
    return found


def markdown(found: dict[str, Any]) -> str:
    held = found.get("heldout") or {}
    lines = ["# The pipeline on a GPU (benchmarks/gpu_pipeline.py)", "",
             f"`grpo-pipeline run --params configs/examples/smollm2_reasoning_gpu.yaml` on {found['card']}: exit "
             f"status {found['exit_status']}, {found['wall_s']} s in all.", "",
             "| stage | seconds |", "|---|---:|",
             *[f"| {name} | {seconds:.1f} |" for name, seconds in found["stage_seconds"].items()], ""]
    if held:
        lines.append(f"Held-out reward (n={held['n']}): {held['before']:.4f} before GRPO, {held['after']:.4f} after, "
                     f"improvement {held['improvement']:+.4f} (95% CI {held['improvement_ci95_low']:+.4f} .. "
                     f"{held['improvement_ci95_high']:+.4f}).")
    lines += [f"GRPO completion tokens/s (median step): {found['grpo_completion_tokens_per_s']}; peak GPU memory in "
              f"use: {found['peak_gpu_memory_in_use_gib']} GiB.",
              f"Served: {json.dumps(found.get('served'))}", f"Versions: {json.dumps(found.get('versions'))}", ""]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--from", dest="out", type=Path, required=True, help="the call's output folder")
    args = parser.parse_args()
    found = record(args.out)
    (RESULTS / "gpu_pipeline.json").write_text(json.dumps(found, indent=1) + "\n")
    (RESULTS / "gpu_pipeline.md").write_text(markdown(found))
    print(markdown(found))
    return 0 if found["exit_status"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
