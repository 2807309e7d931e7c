"""The trainer's whole state across a stop: weights, optimizer, moving reference, RNGs and step history.

Checkpoints are always written in the one-process format (components/data/checkpoints.py), so any
number of processes resumes any checkpoint. With FSDP2 the whole model is restored before it is
sharded, and the optimizer state once the sharded optimizer exists.
"""

from __future__ import annotations

import dataclasses
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from components.config import GRPOConfig
from components.data.checkpoints import BEST, load_checkpoint, load_weights, save_checkpoint
from components.data.paths import Paths
from components.engine.grpo.policy import Policy
from components.engine.models.modeling import save_model
from components.engine.models.optim import make_optimizer
from components.engine.parallel.distributed import DistContext

# Wall-clock metrics differ run to run; they stay out of checkpoints so checkpoints are byte-reproducible.
# Every `time/...` key is one, whatever new timing a later change adds.
TIMING_KEYS = ("step_seconds", "completions_per_s")
TIMING_PREFIX = "time/"


def without_timings(record: dict[str, Any]) -> dict[str, Any]:
    """One step's history record less its wall-clock figures (what a checkpoint keeps)."""
    return {k: v for k, v in record.items() if k not in TIMING_KEYS and not k.startswith(TIMING_PREFIX)}


def optimizer_and_resume(policy: Policy, g: GRPOConfig, ctx: DistContext, resume_from: Path | None,
                         moving_reference: bool) -> tuple[torch.optim.Optimizer, dict[str, Any] | None]:
    """Shard the models (fsdp2), build the optimizer, and load `resume_from` into all of it (None: fresh)."""
    reference = policy.reference if moving_reference else None
    state = held = None
    if ctx.lockstep:
        from components.engine.parallel.fsdp import HeldOptimizerState, shard_model

        if resume_from is not None:
            held = HeldOptimizerState()
            state = load_checkpoint(resume_from, policy.model, held, reference)
        shard_model(policy.model, ctx)
        if policy.reference is not None:
            shard_model(policy.reference, ctx)
    optimizer = make_optimizer(policy.model, g.learning_rate, g.weight_decay, ctx.device)
    if held is not None:
        from components.engine.parallel.fsdp import load_optimizer_state

        load_optimizer_state(policy.model, optimizer, held.state)
    elif resume_from is not None:
        state = load_checkpoint(resume_from, policy.model, optimizer, reference)
    return optimizer, state


def save_training_state(root: Path, step: int, run_hash: str, policy: Policy, optimizer, moving_reference: bool,
                        history: list[dict[str, Any]], rollout_gen: torch.Generator, ctx: DistContext,
                        load_plain: Callable[[], torch.nn.Module]) -> None:
    """checkpoints/grpo/step-N, written by rank 0 (with fsdp2 every rank first gathers its shards)."""
    saved = {"step": step, "rollout_rng": rollout_gen.get_state(),
             "history": [without_timings(h) for h in history],
             "torch_rng": torch.get_rng_state()}
    reference = policy.reference if moving_reference else None
    if ctx.lockstep:
        from components.engine.parallel.fsdp import save_sharded_checkpoint

        save_sharded_checkpoint(root, step, run_hash, policy.model, optimizer, saved, reference, load_plain, ctx)
    elif ctx.is_main:
        save_checkpoint(root, step, run_hash, policy.model, optimizer, saved, reference)


def save_final_model(policy: Policy, out: Path, provenance: dict[str, Any], ctx: DistContext,
                     load_plain: Callable[[], torch.nn.Module]) -> None:
    """models/grpo, atomically: the full model, or with LoRA the adapter alone (MBs, not a second copy of
    the base), its base named in provenance.json so every later stage loads base + adapter. With fsdp2
    the whole model is gathered first; only rank 0 writes."""
    if ctx.lockstep:
        from components.engine.parallel.fsdp import full_model_state, plain_copy

        weights = full_model_state(policy.model)
        if ctx.is_main:
            policy = dataclasses.replace(policy, model=plain_copy(load_plain, weights), reference=None)
    if not ctx.is_main:
        return
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    save_model(policy.model, policy.tokenizer, tmp, extra=provenance)
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)


def save_kept_model(policy: Policy, paths: Paths, history: list[dict[str, Any]], best: dict[str, Any] | None,
                    run_hash: str, start_dir: Path, g: GRPOConfig, ctx: DistContext,
                    load_plain: Callable[[], torch.nn.Module], say: Callable[..., None]) -> dict[str, Any]:
    """models/grpo from the weights the run keeps: the last step's, or (`grpo.keep: best`, `best` set) those of the
    best held-out evaluation, saved aside as checkpoints/grpo/best. Returns what was kept: mode, step, metric, value."""
    kept = {"mode": g.keep, "step": g.steps, "metric": g.keep_metric,
            "value": history[-1].get(f"heldout/{g.keep_metric}") if history else None}
    if best is not None and ctx.is_main:
        load_weights(paths.grpo_checkpoints / BEST, policy.model)
        kept.update(step=best["step"], value=best["value"])
        say(f"grpo: keeping the weights of step {best['step']} (held-out {g.keep_metric} {best['value']:.4f}, "
            f"the best of the evaluations during training) as {paths.grpo_model}")
    provenance = {"stage": "grpo", "run_hash": run_hash, "steps": g.steps, "start": str(start_dir),
                  "kept_step": kept["step"], **({"base_model": str(start_dir)} if policy.lora else {})}
    save_final_model(policy, paths.grpo_model, provenance, ctx, load_plain)
    return kept
