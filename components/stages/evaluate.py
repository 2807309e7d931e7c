"""Stage `evaluate`: greedy held-out reward of the baseline (SFT or base) and the GRPO model.

Both models answer the same prompts; the improvement is paired per prompt and its 95% interval
comes from a seeded bootstrap over prompts. Per-prompt results go to eval/predictions.jsonl, which
register later uses to compare a challenger with the champion on the same prompts.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import numpy as np

from components.config import PipelineConfig, to_flat_dict
from components.data.paths import Paths
from components.data.records import file_md5, read_jsonl, split_path, write_jsonl
from components.engine.heldout import greedy_completions, paired_bootstrap, score
from components.engine.modeling import pick_device, seed_everything
from components.engine.rewards import RewardModel
from components.stages.cli import stage_main


def evaluate(cfg: PipelineConfig, paths: Paths = Paths()) -> dict[str, Any]:
    from components.tracking.runs import stage_run

    e = cfg.evaluate
    seed_everything(cfg.seed, cfg.threads)
    device = pick_device(cfg.device)
    heldout_file = split_path(paths.data, "heldout")
    records = read_jsonl(heldout_file)
    rewards = RewardModel(cfg.grpo.rewards)
    results: dict[str, dict[str, Any]] = {}
    with stage_run(cfg.tracking.experiment, "evaluate", to_flat_dict(cfg)) as run:
        for role, model_dir in (("baseline", paths.sft_model), ("candidate", paths.grpo_model)):
            completions = greedy_completions(cfg, model_dir, records, e.max_new_tokens, e.batch_size, device)
            per_prompt = score(records, completions, rewards)
            results[role] = {"completions": completions, "rewards": per_prompt}
            print(f"evaluate: {role} ({model_dir}) mean reward {np.mean(per_prompt):.4f} on {len(records)} prompts")
        base, cand = np.array(results["baseline"]["rewards"]), np.array(results["candidate"]["rewards"])
        improvement = paired_bootstrap(cand, base, e.bootstrap_samples, cfg.seed)
        report = {
            "n": len(records), "heldout_md5": file_md5(heldout_file),
            "baseline": {"model": str(paths.sft_model), "mean_reward": float(base.mean())},
            "candidate": {"model": str(paths.grpo_model), "mean_reward": float(cand.mean())},
            "improvement": improvement,
        }
        paths.metrics.mkdir(parents=True, exist_ok=True)
        (paths.metrics / "eval.json").write_text(json.dumps(report, indent=2, sort_keys=True) + "\n")
        write_jsonl(paths.eval_dir / "predictions.jsonl", [
            {"id": r.get("id"), "prompt": r["prompt"], "answer": r.get("answer"),
             "baseline_completion": bc, "baseline_reward": br, "candidate_completion": cc, "candidate_reward": cr}
            for r, bc, br, cc, cr in zip(records, results["baseline"]["completions"], base.tolist(),
                                          results["candidate"]["completions"], cand.tolist())])
        run.log_metrics({"baseline_mean_reward": report["baseline"]["mean_reward"],
                         "candidate_mean_reward": report["candidate"]["mean_reward"],
                         "improvement_mean": improvement["mean"], "improvement_ci95_low": improvement["ci95_low"],
                         "improvement_ci95_high": improvement["ci95_high"]})
        run.log_artifact(paths.metrics / "eval.json")
        run.log_artifact(paths.eval_dir / "predictions.jsonl", "eval")
        from components.tracking.reports import log_predictions_table

        log_predictions_table(run.run_id, read_jsonl(paths.eval_dir / "predictions.jsonl"))
    print(f"evaluate: improvement {improvement['mean']:+.4f} "
          f"(95% CI {improvement['ci95_low']:+.4f} .. {improvement['ci95_high']:+.4f})")
    return report


def main(argv: list[str] | None = None) -> int:
    return stage_main("Held-out evaluation.", evaluate, argv)


if __name__ == "__main__":
    sys.exit(main())
