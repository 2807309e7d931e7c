"""Stage `evaluate`: held-out task metrics of the baseline (SFT or base) and the GRPO model.

Both models answer the same prompts. Every metric of `evaluate.metrics` (components/engine/evaluation/task_metrics.py;
`reward`, the training reward, always) is computed per prompt for both, and its improvement is paired
per prompt with a 95% interval from a seeded bootstrap over prompts. Per-prompt values go to
eval/predictions.jsonl, which register later uses to compare a challenger with the champion on the
same prompts and the metric `register.gate_metric` names.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import numpy as np

from components.config import PipelineConfig, to_flat_dict
from components.data.paths import Paths
from components.data.records import file_md5, read_jsonl, split_path, write_jsonl, write_text_atomic
from components.engine.evaluation.heldout import paired_bootstrap
from components.engine.evaluation.task_metrics import TaskMetrics, check_metrics, metric_key
from components.engine.models.modeling import load_policy_model, load_tokenizer, pick_device, seed_everything
from components.stages.cli import stage_main


def evaluate(cfg: PipelineConfig, paths: Paths = Paths()) -> dict[str, Any]:
    from components.tracking.runs import stage_run

    e = cfg.evaluate
    check_metrics(e.metrics)
    seed_everything(cfg.seed, cfg.threads)
    device = pick_device(cfg.device)
    heldout_file = split_path(paths.data, "heldout")
    records = read_jsonl(heldout_file)
    metrics = TaskMetrics(e, cfg.grpo.rewards, cfg=cfg)
    results: dict[str, dict[str, Any]] = {}
    with stage_run(cfg.tracking.experiment, "evaluate", to_flat_dict(cfg)) as run:
        for role, model_dir in (("baseline", paths.sft_model), ("candidate", paths.grpo_model)):
            tokenizer = load_tokenizer(model_dir, cfg.model.trust_remote_code)
            model = load_policy_model(cfg, model_dir, device)
            values, out = metrics.per_prompt(model, tokenizer, records, cfg.seed)
            results[role] = {"completions": out.transcripts, **values}  # an episode: all its turns
            means = ", ".join(f"{name} {np.mean(v):.4f}" for name, v in values.items())
            print(f"evaluate: {role} ({model_dir}) {means} on {len(records)} prompts")
        table = {name: {"baseline": float(np.mean(results["baseline"][name])),
                        "candidate": float(np.mean(results["candidate"][name])),
                        "improvement": paired_bootstrap(np.array(results["candidate"][name]),
                                                        np.array(results["baseline"][name]), e.bootstrap_samples,
                                                        cfg.seed)}
                 for name in metrics.names}
        improvement = table["reward"]["improvement"]
        report = {
            "n": len(records), "heldout_md5": file_md5(heldout_file),
            "baseline": {"model": str(paths.sft_model), "mean_reward": table["reward"]["baseline"]},
            "candidate": {"model": str(paths.grpo_model), "mean_reward": table["reward"]["candidate"]},
            "improvement": improvement, "metrics": table,
        }
        paths.metrics.mkdir(parents=True, exist_ok=True)
        write_text_atomic(paths.metrics / "eval.json", json.dumps(report, indent=2, sort_keys=True) + "\n")
        rows = []
        for i, r in enumerate(records):
            row = {"id": r.get("id"), "prompt": r["prompt"], "answer": r.get("answer"),
                   "baseline_completion": results["baseline"]["completions"][i],
                   "candidate_completion": results["candidate"]["completions"][i]}
            for name in metrics.names:
                row.update({f"baseline_{name}": results["baseline"][name][i],
                            f"candidate_{name}": results["candidate"][name][i]})
            rows.append(row)
        write_jsonl(paths.eval_dir / "predictions.jsonl", rows)
        run.log_metrics({"baseline_mean_reward": report["baseline"]["mean_reward"],
                         "candidate_mean_reward": report["candidate"]["mean_reward"],
                         "improvement_mean": improvement["mean"], "improvement_ci95_low": improvement["ci95_low"],
                         "improvement_ci95_high": improvement["ci95_high"]})
        for name, row in table.items():  # eval/<metric>/{baseline,candidate,improvement,...}
            key = f"eval/{metric_key(name)}"
            run.log_metrics({f"{key}/baseline": row["baseline"], f"{key}/candidate": row["candidate"],
                             f"{key}/improvement": row["improvement"]["mean"],
                             f"{key}/improvement_ci95_low": row["improvement"]["ci95_low"],
                             f"{key}/improvement_ci95_high": row["improvement"]["ci95_high"]})
        run.log_artifact(paths.metrics / "eval.json")
        run.log_artifact(paths.eval_dir / "predictions.jsonl", "eval")
        from components.tracking.reports import log_predictions_table

        log_predictions_table(run, read_jsonl(paths.eval_dir / "predictions.jsonl"))
    for name, row in table.items():
        imp = row["improvement"]
        print(f"evaluate: {name}: {row['baseline']:.4f} -> {row['candidate']:.4f}, improvement {imp['mean']:+.4f} "
              f"(95% CI {imp['ci95_low']:+.4f} .. {imp['ci95_high']:+.4f})")
    return report


def main(argv: list[str] | None = None) -> int:
    return stage_main("Held-out evaluation.", evaluate, argv)


if __name__ == "__main__":
    sys.exit(main())
