"""`--dry-run`: check config, data and model end to end, run one rollout and one loss, train nothing.

Everything happens in a scratch directory with a scratch MLflow store: the repository, its
outputs and the real tracking server are left untouched.
"""

from __future__ import annotations

import math
import os
import tempfile
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from components.config import PipelineConfig
from components.engine.rewards.rewards import RewardResult


def dry_run(cfg: PipelineConfig) -> dict[str, Any]:
    from components.data.paths import Paths
    from components.data.records import read_jsonl, split_path
    from components.engine.grpo.batch import (
        PromptSchedule,
        collect_batch,
        one_process_round,
        reward_specs,
        sampling_params,
    )
    from components.engine.grpo.objectives import build_loss
    from components.engine.grpo.policy import build_policy
    from components.engine.grpo.trajectory import build_trajectory
    from components.engine.models.modeling import count_parameters, pick_device, seed_everything
    from components.engine.rewards.rewards import RewardModel
    from components.stages.model import build_base_model
    from components.stages.prepare import prepare
    from components.stages.validate import validate

    g = cfg.grpo
    previous_uri = os.environ.get("MLFLOW_TRACKING_URI")
    with tempfile.TemporaryDirectory(prefix="grpo-dry-run-") as tmp:
        os.environ["MLFLOW_TRACKING_URI"] = f"sqlite:///{Path(tmp) / 'scratch.db'}"
        try:
            device = pick_device(cfg.device)  # the cheapest check first: before the data is prepared and validated
            paths = Paths(root=Path(tmp))
            prepare(cfg, paths)
            build_base_model(cfg, paths)
            validate(cfg, paths)
            seed_everything(cfg.seed, cfg.threads)
            records = read_jsonl(split_path(paths.data, "train"))
            loss = build_loss(g)  # the trainer's loss object, built the same way
            policy, _ = build_policy(cfg, paths.base_model.resolve(), device, records,
                                     with_reference=loss.uses_reference)
            schedule = PromptSchedule(len(records), g.prompts_per_step, cfg.seed)
            sample_round = one_process_round(policy, records, sampling_params(g), RewardModel(reward_specs(g)), g,
                                             torch.Generator(device=device).manual_seed(cfg.seed + 1))
            batch = collect_batch(sample_round, schedule, 0, g, policy.tokenizer.pad_token_id)
            rollouts = batch.rollouts
            with torch.no_grad():
                ref = policy.reference_logprobs(rollouts) if loss.uses_reference else None
                trajectory = build_trajectory(rollouts, batch.advantage_rewards, loss, g.mask_truncated_completions,
                                              ref)
                logp, _ = policy.logprobs(rollouts)
                out = loss(logp, logp, trajectory.advantages, trajectory.loss_mask, ref_logp=ref)
            reading = policy.generation.read(rollouts)
            completions = reading.transcripts
            endings = reading.endings if len(rollouts) == len(batch.rewards.total) else None
            report = {"parameters": count_parameters(policy.model), "completions": batch.sampled,
                      **reward_summary(batch.rewards, endings), "loss": float(out.loss),
                      "kl": float(out.kl), "examples": examples(batch.records, completions, rollouts.group_size)}
        finally:
            if previous_uri is None:
                os.environ.pop("MLFLOW_TRACKING_URI", None)
            else:
                os.environ["MLFLOW_TRACKING_URI"] = previous_uri
    print(f"dry run: config, data and model valid; one rollout of {report['completions']} completions, "
          f"{report['reward_said']}, loss {report['loss']:+.4f}; nothing was trained or written")
    return report


def examples(records: Sequence[dict[str, Any]], completions: Sequence[str], group_size: int,
             count: int = 3) -> list[dict[str, str]]:
    """The first `count` kept groups' prompts, each with its group's first completion (dynamic sampling keeps some
    groups only: each group's own record, not the step's schedule)."""
    return [{"prompt": record["prompt"], "completion": completions[k * group_size]}
            for k, record in enumerate(records[:count])]


def reward_summary(rewards: RewardResult, endings: Sequence[str] | None) -> dict[str, Any]:
    """The rollout's reward mean over the completions some reward scored, and, for those none scored (their reward
    is missing: left out of their group's comparison), why: which rewards returned None, and how those episodes
    ended (`endings`, the generation's words: cut at a limit, an environment error, ended without a reward of the
    environment's own)."""
    scorable = rewards.scorable
    scored = [total for total, ok in zip(rewards.total, scorable) if ok]
    missing = [i for i, ok in enumerate(scorable) if not ok]
    mean = sum(scored) / len(scored) if scored else math.nan
    if not missing:
        return {"reward_mean": mean, "unscored": 0, "reward_said": f"reward mean {mean:.3f}"}
    names = ", ".join(rewards.components) or "none configured"
    why = f"every reward ({names}) returned None for them"
    if endings is not None:
        ends = Counter(endings[i] for i in missing)
        why += ": " + ", ".join(f"{count} episode{'s' if count > 1 else ''} {how}" for how, count in ends.most_common())
    head = f"reward mean {mean:.3f} over the {len(scored)} scored" if scored else "no reward mean"
    said = f"{head} ({len(missing)} of {len(scorable)} completions have no reward: {why})"
    return {"reward_mean": mean, "unscored": len(missing), "unscored_why": why, "reward_said": said}
