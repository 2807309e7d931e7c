"""`--dry-run`: check config, data and model end to end, run one rollout and one loss, train nothing.

Everything happens in a scratch directory with a scratch MLflow store: the repository, its
outputs and the real tracking server are left untouched.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

import torch

from components.config import PipelineConfig


def dry_run(cfg: PipelineConfig) -> dict[str, Any]:
    from components.data.paths import Paths
    from components.data.records import read_jsonl, split_path
    from components.engine.grpo.objectives import build_loss
    from components.engine.grpo.policy import build_policy
    from components.engine.grpo.sampling import PromptSchedule, collect_batch, reward_specs
    from components.engine.grpo.trajectory import loss_mask
    from components.engine.models.modeling import count_parameters, pick_device, seed_everything
    from components.engine.models.rollout import decode_completions
    from components.engine.rewards.rewards import RewardModel
    from components.stages.model import build_base_model
    from components.stages.prepare import prepare
    from components.stages.validate import validate

    g = cfg.grpo
    previous_uri = os.environ.get("MLFLOW_TRACKING_URI")
    with tempfile.TemporaryDirectory(prefix="grpo-dry-run-") as tmp:
        os.environ["MLFLOW_TRACKING_URI"] = f"sqlite:///{Path(tmp) / 'scratch.db'}"
        try:
            paths = Paths(root=Path(tmp))
            prepare(cfg, paths)
            build_base_model(cfg, paths)
            validate(cfg, paths)
            seed_everything(cfg.seed, cfg.threads)
            device = pick_device(cfg.device)
            records = read_jsonl(split_path(paths.data, "train"))
            loss = build_loss(g)  # the trainer's loss object, built the same way
            policy = build_policy(cfg, paths.base_model.resolve(), device, records, with_reference=loss.uses_reference)
            schedule = PromptSchedule(len(records), g.prompts_per_step, cfg.seed)
            batch = collect_batch(policy, records, schedule, 0, g, RewardModel(reward_specs(g)),
                                  torch.Generator(device=device).manual_seed(cfg.seed + 1))
            rollout, rewards = batch.rollout, torch.tensor(batch.totals)
            with torch.no_grad():
                logp, _ = policy.logprobs(rollout, g.temperature)
                ref = policy.reference_logprobs(rollout, g.temperature) if loss.uses_reference else None
                mask = loss_mask(rollout, ~torch.isnan(rewards), g.mask_truncated_completions)
                out = loss(logp, logp, loss.advantages(rewards), mask, ref_logp=ref)
            completions = decode_completions(policy.tokenizer, rollout)
            report = {"parameters": count_parameters(policy.model), "completions": batch.sampled,
                      "reward_mean": float(rewards.nanmean()) if len(rewards) else 0.0, "loss": float(out.loss),
                      "kl": float(out.kl), "examples": [{"prompt": records[i]["prompt"], "completion": completions[j]}
                                                        for j, i in enumerate(schedule.indices(0)[:3])]}
        finally:
            if previous_uri is None:
                os.environ.pop("MLFLOW_TRACKING_URI", None)
            else:
                os.environ["MLFLOW_TRACKING_URI"] = previous_uri
    print(f"dry run: config, data and model valid; one rollout of {report['completions']} completions, "
          f"reward mean {report['reward_mean']:.3f}, loss {report['loss']:+.4f}; nothing was trained or written")
    return report
