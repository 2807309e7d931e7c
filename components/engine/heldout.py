"""Greedy held-out reward of one model directory or training checkpoint (for evaluating many at once).

Accepts an HF model directory (models/sft, models/grpo, a pointer) or a GRPO training checkpoint
(checkpoints/grpo/step-N: safetensors weights without config or tokenizer, loaded into the start
model's architecture). One call is self-contained, so a task runner can run several in parallel.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from components.data.checkpoints import TRAINABLE_FILE
from components.config import PipelineConfig
from components.data.records import file_md5, read_jsonl, split_path
from components.engine.modeling import (ModelLoadError, load_policy_model, load_tokenizer, pick_device, resolve_model_dir,
                                 seed_everything)
from components.data.paths import Paths
from components.engine.prompting import PromptFormatter
from components.engine.rewards import RewardModel
from components.engine.rollout import decode_completions, sample_groups


def is_training_checkpoint(path: Path) -> bool:
    weights = (path / "model.safetensors").exists() or (path / TRAINABLE_FILE).exists()
    return weights and (path / "meta.json").exists() and not (path / "config.json").exists()


def load_for_eval(cfg: PipelineConfig, path: Path, paths: Paths, device):
    """(tokenizer, model) for an HF directory or a training checkpoint (start model + its weights)."""
    if not path.exists():
        raise ModelLoadError(f"{path}: no such model directory or checkpoint")
    if not is_training_checkpoint(path):
        return load_tokenizer(path, cfg.model.trust_remote_code), load_policy_model(cfg, path, device)
    from safetensors.torch import load_model

    if (path / TRAINABLE_FILE).exists():
        raise ModelLoadError(f"{path}: a LoRA training checkpoint holds only the adapter's optimizer state; "
                             "evaluate models/grpo (the base model plus the final adapter)")
    start = resolve_model_dir(paths.sft_model)
    model = load_policy_model(cfg, start, device)
    try:
        load_model(model, str(path / "model.safetensors"))
    except RuntimeError as err:
        raise ModelLoadError(f"{path}: weights do not fit the start model {start} (a LoRA checkpoint? evaluate "
                             f"models/grpo, where the adapters are merged): {str(err)[:200]}") from err
    return load_tokenizer(start, cfg.model.trust_remote_code), model.eval()


def score_checkpoint(cfg: PipelineConfig, path: Path, paths: Paths = Paths()) -> dict[str, Any]:
    """Mean greedy reward on the held-out split, with per-prompt completions and rewards."""
    from components.data.records import reward_columns

    e = cfg.evaluate
    seed_everything(cfg.seed, cfg.threads)
    device = pick_device(cfg.device)
    tokenizer, model = load_for_eval(cfg, Path(path), paths, device)
    heldout = split_path(paths.data, "heldout")
    records = read_jsonl(heldout)
    formatter = PromptFormatter(cfg.prompt, tokenizer)
    prompts = [formatter(r) for r in records]
    completions: list[str] = []
    for start in range(0, len(prompts), e.batch_size):
        rollout = sample_groups(model, tokenizer, prompts[start: start + e.batch_size], 1, e.max_new_tokens,
                                greedy=True)
        completions += decode_completions(tokenizer, rollout)
    rewards = RewardModel(cfg.grpo.rewards)([r["prompt"] for r in records], completions,
                                            reward_columns(records, 1)).total
    return {"checkpoint": str(path), "n": len(records), "heldout_md5": file_md5(heldout),
            "mean_reward": float(np.mean(rewards)), "rewards": rewards, "completions": completions}
