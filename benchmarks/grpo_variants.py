"""Report: what each GRPO variant does to held-out reward here, from one warm start, over seeds.

For a task (`--task default`: the embedded default; `--task smollm2`: configs/examples/smollm2_addition.yaml) the
data, the base model and (where the task has one) the SFT warm start are built once; each variant then runs the
real grpo stage from them with the same number of sampled completions, once per seed, and the real evaluate stage
scores it on the held-out split. Seeds vary the GRPO run only (sampling, prompt order), so the spread is GRPO's.
Each run's on-policy check (the mean and largest |sampler log-prob - trainer log-prob|, from plots/grpo_steps.csv)
is recorded beside it. Not a test: it reports, it does not assert; it is not a contest either.

    python benchmarks/grpo_variants.py --task default --seeds 1 2 3          # each run's seconds: the JSON
    python benchmarks/grpo_variants.py --task smollm2 --seeds 1 2 3

The SmolLM2 runs take 20 steps where the example takes 40: each step here costs an extra forward (the old log-probs)
and the example's first 20 steps already carry most of its gain.

Every variant, the baseline included, runs two optimizer steps per rollout (each on half of its groups), so the
importance ratio moves off 1 for half of the rows: CISPO and SAPO reshape that ratio and would otherwise equal
DAPO and GRPO exactly. Results go to benchmarks/results/grpo_variants_<task>.{json,md}, a row as soon as it ends
(`--resume` skips the runs already there). Each run's GRPO seconds are in the JSON, not the table: what the
variants change is the reward, and runs may share the machine.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

MULTI_REWARD = ["grpo.rewards=[{name: exact_match, weight: 1.0, options: {extract: %s}}, "
                "{name: distinct_ngrams, weight: 0.5, options: {n: 2}}]"]
VARIANTS: dict[str, list[str]] = {
    "dapo": [],
    "cispo": ["grpo.loss_type=cispo"],
    "sapo": ["grpo.loss_type=sapo"],
    "dapo, top 20% entropy tokens": ["grpo.top_entropy_quantile=0.2"],
    "exact + 0.5 diversity, summed": MULTI_REWARD,
    "exact + 0.5 diversity, GDPO": MULTI_REWARD + ["grpo.multi_objective_aggregation=normalize_then_sum"],
    # the aggregation variants of an earlier table (docs/engine.md), on request: --variants grpo dr_grpo reinforce
    "grpo": ["grpo.loss_type=grpo"],
    "dr_grpo": ["grpo.loss_type=dr_grpo", "grpo.scale_rewards=none"],
    "reinforce": ["grpo.algorithm=reinforce", "grpo.group_size=1", "grpo.kl_beta=0", "grpo.prompts_per_step=128"],
}
DEFAULT_VARIANTS = ["dapo", "cispo", "sapo", "dapo, top 20% entropy tokens", "exact + 0.5 diversity, summed",
                    "exact + 0.5 diversity, GDPO"]
TASKS = {
    "default": {"params": None, "steps": 600, "extract": "null",
                "common": ["grpo.minibatch_size=64", "grpo.gradient_accumulation_steps=1"]},
    "smollm2": {"params": "configs/examples/smollm2_addition.yaml", "steps": 20, "extract": "last_number",
                "common": ["grpo.minibatch_size=32", "grpo.gradient_accumulation_steps=1", "task.n_heldout=200",
                           "evaluate.metrics=[reward]"]},
}


def gap(paths) -> dict[str, float]:
    """The run's on-policy check over its steps: the mean of each step's mean gap, and the largest token gap."""
    with open(paths.plots / "grpo_steps.csv") as f:
        rows = [r for r in csv.DictReader(f) if r.get("logprob_gap_mean")]
    if not rows:
        return {}
    return {"gap_mean": statistics.fmean(float(r["logprob_gap_mean"]) for r in rows),
            "gap_max": max(float(r["logprob_gap_max"]) for r in rows)}


def summary(rows: list[dict], variant: str) -> dict | None:
    runs = [r for r in rows if r["variant"] == variant]
    if not runs:
        return None
    gains = [r["improvement_mean"] for r in runs]
    return {"n": len(runs), "final": statistics.median(r["final"] for r in runs),
            "gain": statistics.median(gains), "low": min(gains), "high": max(gains),
            "ci_low_min": min(r["improvement_ci95_low"] for r in runs),
            "gap_mean": max(r.get("gap_mean", 0.0) for r in runs), "gap_max": max(r.get("gap_max", 0.0) for r in runs)}


def render(task: str, rows: list[dict], meta: dict) -> str:
    lines = [f"# GRPO variants from one warm start: {task}", "",
             f"`python benchmarks/grpo_variants.py --task {task} --seeds {' '.join(map(str, meta['seeds']))}` on "
             f"{meta['machine']}. {meta['completions']} sampled completions a run, two optimizer steps per rollout "
             "for every row (see the script). Held-out reward after GRPO; improvement over the warm start with its "
             "paired 95% CI; median and range over the seeds. The on-policy gap is the largest over the runs "
             "(per-step mean |sampler - trainer log-prob|, and the largest single token).", "",
             "| variant | seeds | held-out after (median) | improvement: median (range) | lowest CI low "
             "| on-policy gap mean / max |", "|---|---|---|---|---|---|"]
    for variant in VARIANTS:
        s = summary(rows, variant)
        if s:
            lines.append(f"| {variant} | {s['n']} | {s['final']:.3f} | {s['gain']:+.3f} ({s['low']:+.3f} .. "
                         f"{s['high']:+.3f}) | {s['ci_low_min']:+.3f} | "
                         f"{s['gap_mean']:.1e} / {s['gap_max']:.1e} |")
    lines += ["", "Runs:", "", "| variant | seed | before | after | improvement (95% CI) | on-policy gap mean / max |",
              "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['variant']} | {r['seed']} | {r['baseline']:.3f} | {r['final']:.3f} | "
                     f"{r['improvement_mean']:+.3f} ({r['improvement_ci95_low']:+.3f} .. "
                     f"{r['improvement_ci95_high']:+.3f}) | {r.get('gap_mean', 0):.1e} / {r.get('gap_max', 0):.1e} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--task", choices=sorted(TASKS), default="default")
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--steps", type=int, default=0, help="GRPO steps (0: the task's)")
    parser.add_argument("--variants", nargs="*", default=DEFAULT_VARIANTS, choices=list(VARIANTS),
                        help="which variants (default: the first six)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], help="extra params overrides")
    parser.add_argument("--resume", action="store_true", help="keep the runs already in the results file")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = parser.parse_args()
    import torch

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
    from components.config import load_config
    from components.data.paths import Paths
    from components.stages.evaluate import evaluate
    from components.stages.grpo import train_grpo
    from components.stages.model import build_base_model
    from components.stages.prepare import prepare
    from components.stages.sft import train_sft
    from components.stages.validate import validate
    from components.tracking.run_environment import cpu_model

    task = TASKS[args.task]
    params = ROOT / (task["params"] or "params.yaml")
    steps = args.steps or task["steps"]
    common = [f"grpo.steps={steps}", "grpo.checkpoint_every=0", f"grpo.log_every={max(1, steps // 4)}",
              "evaluate.every=0", *task["common"], *args.overrides]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result_file = out / f"grpo_variants_{args.task}.json"
    rows = json.loads(result_file.read_text())["rows"] if args.resume and result_file.exists() else []
    work = Path(tempfile.mkdtemp(prefix="grpo-variants-"))
    os.environ["MLFLOW_TRACKING_URI"] = f"sqlite:///{work / 'mlflow.db'}"
    base_cfg = load_config(params, common)
    shared = Paths(root=work / "shared")
    prepare(base_cfg, shared)
    build_base_model(base_cfg, shared)
    validate(base_cfg, shared)
    train_sft(base_cfg, shared)
    g0 = base_cfg.grpo
    meta = {"seeds": args.seeds, "steps": steps, "overrides": common,
            "completions": steps * g0.prompts_per_step * g0.group_size,
            "machine": f"{cpu_model()} ({os.cpu_count()} cores, {torch.backends.cpu.get_cpu_capability()}), "
                       f"{time.strftime('%Y-%m-%d')}"}
    for seed in args.seeds:  # seed-major: a run cut short still has every variant on its first seeds
        for name in args.variants:
            overrides = [o % task["extract"] if "%s" in o else o for o in VARIANTS[name]]
            if any(r["variant"] == name and r["seed"] == seed for r in rows):
                continue
            cfg = load_config(params, common + overrides + [f"seed={seed}"])
            paths = Paths(root=work / f"{name}-{seed}".replace(" ", "_").replace(",", "").replace("%", ""))
            for sub in ("data/prepared", "models/base", "models/sft"):
                if (shared.root / sub).exists():
                    shutil.copytree(shared.root / sub, paths.root / sub)
            started = time.perf_counter()
            train_grpo(cfg, paths)
            seconds = time.perf_counter() - started
            report = evaluate(cfg, paths)
            rows.append({"variant": name, "seed": seed, "grpo_seconds": round(seconds, 1),
                         "baseline": report["baseline"]["mean_reward"], "final": report["candidate"]["mean_reward"],
                         **{f"improvement_{k}": v for k, v in report["improvement"].items()}, **gap(paths)})
            print(f"{name} seed {seed}: {rows[-1]['baseline']:.3f} -> {rows[-1]['final']:.3f} "
                  f"({seconds:.0f} s)", flush=True)
            meta["seeds"] = sorted({r["seed"] for r in rows})  # with --resume: every seed in the file
            result_file.write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")
            (out / f"grpo_variants_{args.task}.md").write_text(render(args.task, rows, meta))
            shutil.rmtree(paths.root, ignore_errors=True)
    print("\n" + render(args.task, rows, meta))
    shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
