"""Report: do `grpo`, `dapo` and `dr_grpo` each raise held-out reward from the same warm start?

One SFT warm start is built once; each variant then runs the real grpo stage from it with the same
number of sampled completions (reinforce samples one completion per prompt, so it sees G times more
prompts per step), and the real evaluate stage scores it on the held-out split. Prints a table and
writes benchmarks/results/grpo_variants.{json,md}. Not a test: it reports, it does not assert.

    python benchmarks/grpo_variants.py --steps 600          # about 8 minutes on 2 CPU cores
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

VARIANTS = {
    "grpo": ["grpo.loss_type=grpo", "grpo.scale_rewards=group"],
    "dapo": ["grpo.loss_type=dapo", "grpo.scale_rewards=group"],
    "dr_grpo": ["grpo.loss_type=dr_grpo", "grpo.scale_rewards=none"],
    "reinforce": ["grpo.algorithm=reinforce", "grpo.group_size=1", "grpo.kl_beta=0", "grpo.prompts_per_step=128"],
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--set", dest="overrides", action="append", default=[], help="extra params overrides")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
    from components.config import load_config
    from components.data.paths import Paths
    from components.stages.evaluate import evaluate
    from components.stages.grpo import train_grpo
    from components.stages.model import build_base_model
    from components.stages.prepare import prepare
    from components.stages.sft import train_sft

    work = Path(tempfile.mkdtemp(prefix="grpo-variants-"))
    os.environ["MLFLOW_TRACKING_URI"] = f"sqlite:///{work / 'mlflow.db'}"
    common = [f"grpo.steps={args.steps}", "grpo.checkpoint_every=0", f"grpo.log_every={max(1, args.steps // 4)}",
              *args.overrides]
    base_cfg = load_config(ROOT / "params.yaml", common)
    configs = {name: load_config(ROOT / "params.yaml", common + overrides) for name, overrides in VARIANTS.items()}
    shared = Paths(root=work / "shared")
    prepare(base_cfg, shared)
    build_base_model(base_cfg, shared)
    train_sft(base_cfg, shared)
    rows = []
    for name, cfg in configs.items():
        paths = Paths(root=work / name)
        for sub in ("data/prepared", "models/base", "models/sft"):
            shutil.copytree(shared.root / sub, paths.root / sub)
        started = time.perf_counter()
        train_grpo(cfg, paths)
        seconds = time.perf_counter() - started
        report = evaluate(cfg, paths)
        g = cfg.grpo
        rows.append({"variant": name, "steps": g.steps, "completions": g.steps * g.prompts_per_step * g.group_size,
                     "grpo_seconds": round(seconds, 1), "baseline": report["baseline"]["mean_reward"],
                     "final": report["candidate"]["mean_reward"], **{f"improvement_{k}": v
                                                                      for k, v in report["improvement"].items()}})
    header = "| variant | steps | completions | GRPO s | held-out before | after | improvement (95% CI) |"
    lines = [header, "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['variant']} | {r['steps']} | {r['completions']} | {r['grpo_seconds']} | "
                     f"{r['baseline']:.3f} | {r['final']:.3f} | {r['improvement_mean']:+.3f} "
                     f"({r['improvement_ci95_low']:+.3f} .. {r['improvement_ci95_high']:+.3f}) |")
    table = "\n".join(lines)
    print("\n" + table)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "grpo_variants.json").write_text(json.dumps({"rows": rows, "overrides": common}, indent=2) + "\n")
    (out / "grpo_variants.md").write_text(f"# GRPO variants from one warm start\n\n`python benchmarks/grpo_variants.py "
                                          f"--steps {args.steps}`\n\n{table}\n")
    shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
