"""Report: the held-out curve beside the training reward, on runs that generalise and one that cannot.

The evidence behind the `heldout_flat` monitor's default (components/engine/evaluation/monitors.py). Each row is one
`grpo-pipeline run` in a fresh clone of this commit (sharing this checkout's .venv): the embedded default,
both SmolLM2 examples, and `random_labels`, a task no rule can learn (a random 6-character prompt, an answer
drawn at random from 0-3): training can only memorise its 300 prompts, so the held-out reward cannot rise.
Per run: the training reward's rise over the run, the held-out change over the start model (paired, on the
`evaluate.during_training_n` prompts) with its noise, the monitor's value and verdict, and the held-out
evaluation's improvement (the evaluate stage, all held-out prompts). Writes
benchmarks/results/heldout_curves.{json,md} after every run; not a test.

    python benchmarks/heldout_curves.py                          # every case (~45 min on 2 cores)
    python benchmarks/heldout_curves.py --cases default random_labels --seeds 1 2 --update   # more seeds
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def random_labels(clone: Path, seed: int) -> list[str]:
    """Write data/user/random_labels_{sft,train,heldout}.jsonl; return the `--set`s that use them."""
    rng = random.Random(seed)
    chars = "abcdefghijklmnopqrstuvwxyz0123456789"

    def rows(n: int, split: str) -> str:
        return "".join(json.dumps({"id": f"{split}-{i}", "prompt": "".join(rng.choices(chars, k=6)) + "=",
                                   "answer": str(rng.randrange(4))}) + "\n" for i in range(n))

    sets = []
    for split, n in (("sft", 1500), ("train", 300), ("heldout", 200)):
        path = clone / "data" / "user" / f"random_labels_{split}.jsonl"
        path.write_text(rows(n, split))
        sets.append(f"data.{split}_path=data/user/{path.name}")
    # SFT only teaches the answer's form (one digit); the labels cannot be learnt, so it stops at 0.2.
    return sets + ["sft.stop_at_reward=0.2", "register.model_name=grpo-random-labels"]


CASES: dict[str, tuple[list[str], Callable[[Path, int], list[str]] | None]] = {
    "default": ([], None),
    "random_labels": ([], random_labels),
    "smollm2_addition": (["--params", "configs/examples/smollm2_addition.yaml"], None),
    "smollm2_reasoning": (["--params", "configs/examples/smollm2_reasoning.yaml"], None),
}
"""name: (grpo-pipeline run arguments, a function writing its data into the clone and returning its --sets)."""


def one_run(case: str, seed: int, work: Path) -> dict[str, Any]:
    from benchmarks.pipeline_overhead import fresh_clone, pipeline_run

    args, data = CASES[case]
    fresh_clone(work)  # the data goes into the clone first; pipeline_run clones again only when asked to
    sets = [f"seed={seed}", *(data(work, seed) if data else [])]
    wall = pipeline_run(work, [*args, *[a for s in sets for a in ("--set", s)]], work.parent / f"{case}-{seed}.log",
                        fresh=False)
    grpo = json.loads((work / "metrics" / "grpo.json").read_text())
    report = json.loads((work / "metrics" / "eval.json").read_text())
    import csv

    with (work / "plots" / "grpo_steps.csv").open() as fh:  # the no-signal warning's evidence: steps 1-10
        first = [float(row["zero_std_group_frac"]) for row, _ in zip(csv.DictReader(fh), range(10))]
    flat = next((m for m in grpo["monitors"] if m["signal"] == "heldout_flat"), {})
    g = grpo.get("generalisation") or {}
    return {"case": case, "seed": seed, "grpo_steps": grpo["steps"],
            "curve": [[e["step"], e.get("reward")] for e in grpo.get("heldout_evaluations", [])],
            "train_gain": g.get("train_gain"), "heldout_gain": g.get("heldout_gain"),
            "heldout_noise": g.get("heldout_noise"), "heldout_rose": g.get("heldout_rose"),
            "heldout_flat": flat.get("last_value"), "breached": flat.get("breached"), "verdict": g.get("text"),
            "zero_variance_first_10_steps": round(sum(first) / len(first), 3),
            "improvement": report["improvement"]["mean"], "ci95_low": report["improvement"]["ci95_low"],
            "ci95_high": report["improvement"]["ci95_high"], "n": report["n"], "wall_s": round(wall, 1)}


def markdown(result: dict[str, Any]) -> str:
    lines = ["# The held-out curve beside the training reward", "",
             f"`{result['command']}` at {result['commit']} on {result['machine']}. One fresh clone and one "
             "`grpo-pipeline run` per row. *Training rise*: the mean training reward of the last w steps minus "
             "the first w (w = min(monitors.window, steps / 4)). *Held-out change*: the last evaluation during "
             "training minus the start model's, paired on the same prompts, with its noise (1.96 standard "
             "errors). *heldout_flat*: the monitor's value (the training rise when the held-out change is "
             "within its noise, else 0); default rule `above 0.1`, action warn. *Evaluate*: the evaluate "
             "stage's improvement over the start on every held-out prompt. *Alike, steps 1-10*: the share of groups "
             "whose completions all scored the same over the first 10 steps (the no-signal warning says so above "
             "0.9).", "",
             "| case | seed | steps | training rise | held-out change (noise) | heldout_flat | warned | evaluate: "
             "improvement (95% CI), n | alike, steps 1-10 | wall (s) |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        change = "-" if r["heldout_gain"] is None else f"{r['heldout_gain']:+.3f} (±{r['heldout_noise']:.3f})"
        rise = "-" if r["train_gain"] is None else f"{r['train_gain']:+.3f}"
        flat = "-" if r["heldout_flat"] is None else f"{r['heldout_flat']:.3f}"
        lines.append(f"| {r['case']} | {r['seed']} | {r['grpo_steps']} | {rise} | {change} | {flat} | "
                     f"{'yes' if r['breached'] else 'no'} | {r['improvement']:+.3f} ({r['ci95_low']:+.3f} .. "
                     f"{r['ci95_high']:+.3f}), {r['n']} | {r.get('zero_variance_first_10_steps', '-')} | "
                     f"{r['wall_s']:.0f} |")
    lines += ["", "Held-out curves (step: reward):", ""]
    lines += [f"- {r['case']} seed {r['seed']}: " + ", ".join(f"{s}: {v:.3f}" for s, v in r["curve"])
              for r in result["rows"]]
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", nargs="+", choices=sorted(CASES), default=list(CASES))
    parser.add_argument("--seeds", type=int, nargs="+", default=[1234, 1, 2],
                        help="seeds of the tiny-model cases (default, random_labels)")
    parser.add_argument("--smollm2-seeds", type=int, nargs="+", default=[1234])
    parser.add_argument("--work", default=str(ROOT / "benchmarks" / ".work" / "heldout-curves"))
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    parser.add_argument("--update", action="store_true", help="keep the report's rows of other cases and seeds")
    args = parser.parse_args()
    import torch

    from components.tracking.run_environment import cpu_model

    plan = [(case, seed) for case in args.cases
            for seed in (args.smollm2_seeds if case.startswith("smollm2") else args.seeds)]
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout
    result = {"command": "python benchmarks/heldout_curves.py " + " ".join(sys.argv[1:]), "commit": commit.strip(),
              "machine": f"{cpu_model()} ({os.cpu_count()} cores, {torch.backends.cpu.get_cpu_capability()}), "
                         f"Python {platform.python_version()}, torch {torch.__version__}", "rows": []}
    out = Path(args.out)
    if args.update and (out / "heldout_curves.json").exists():
        earlier = json.loads((out / "heldout_curves.json").read_text())
        result["rows"] = [r for r in earlier["rows"] if (r["case"], r["seed"]) not in plan]
    out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    for i, (case, seed) in enumerate(plan, 1):
        r = one_run(case, seed, Path(args.work) / "clone")
        result["rows"].append(r)
        result["rows"].sort(key=lambda row: (list(CASES).index(row["case"]), row["seed"]))
        (out / "heldout_curves.json").write_text(json.dumps(result, indent=2) + "\n")
        (out / "heldout_curves.md").write_text(markdown(result))
        elapsed = time.perf_counter() - started
        print(f"[{i}/{len(plan)}] {case} seed {seed}: {r['verdict']} | heldout_flat {r['heldout_flat']} | "
              f"evaluate {r['improvement']:+.3f} ({r['ci95_low']:+.3f} .. {r['ci95_high']:+.3f}) | {r['wall_s']:.0f} s "
              f"| elapsed {elapsed / 60:.0f} min", flush=True)
    print(markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
