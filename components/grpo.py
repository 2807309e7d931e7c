"""Stage `grpo`: Group Relative Policy Optimization, readable top to bottom.

Each step: pick prompts -> sample G completions per prompt -> score them -> group-relative
advantages -> (reference log-probs once) -> `num_iterations` clipped-surrogate updates -> update the
reference (ema/periodic) -> log -> checkpoint. Resumes from the newest complete checkpoint trained
from the same inputs; on CPU with a fixed seed a resumed run ends with the same weights.
"""

from __future__ import annotations

import copy
import csv
import json
import math
import shutil
import sys
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from components.checkpoints import discard_foreign, latest_checkpoint, load_checkpoint, save_checkpoint
from components.config import GRPOConfig, PipelineConfig, section_hash, to_flat_dict
from components.data import dir_md5, file_md5, read_jsonl, split_path
from components.modeling import load_model, load_tokenizer, pick_device, resolve_model_dir, save_model, seed_everything
from components.objectives import group_advantages, masked_entropy, policy_loss
from components.paths import Paths
from components.rewards import RewardModel
from components.rollout import completion_logprobs, decode_completions, sample_groups
from components.stage_cli import StageFailed, stage_main

MAX_BAD_STEPS = 3
# Wall-clock metrics differ run to run; they stay out of checkpoints so checkpoints are byte-reproducible.
TIMING_KEYS = ("step_seconds", "completions_per_s", "time/generation", "time/reward", "time/reference", "time/policy")


def learning_rate(step: int, g: GRPOConfig) -> float:
    """Linear warmup, then cosine decay to `min_lr_ratio` of the peak."""
    if step < g.warmup_steps:
        return g.learning_rate * (step + 1) / g.warmup_steps
    progress = (step - g.warmup_steps) / max(1, g.steps - g.warmup_steps)
    cosine = 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))
    return g.learning_rate * (g.min_lr_ratio + (1.0 - g.min_lr_ratio) * cosine)


class PromptSchedule:
    """Which prompts step k uses: a fresh seeded permutation per epoch, a pure function of the step.

    Being a function of the step alone, resume needs no data-loader state.
    """

    def __init__(self, n: int, per_step: int, seed: int):
        self.n, self.per_step, self.seed = n, per_step, seed
        self._perms: dict[int, list[int]] = {}

    def _perm(self, epoch: int) -> list[int]:
        if epoch not in self._perms:
            gen = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._perms = {epoch: torch.randperm(self.n, generator=gen).tolist()}
        return self._perms[epoch]

    def indices(self, step: int) -> list[int]:
        start = step * self.per_step
        return [self._perm(k // self.n)[k % self.n] for k in range(start, start + self.per_step)]


def reward_columns(records: list[dict[str, Any]], group_size: int) -> dict[str, list[Any]]:
    """Every column except prompt, repeated per completion, passed to reward functions as keywords."""
    keys = sorted({k for r in records for k in r} - {"prompt"})
    return {k: [r.get(k) for r in records for _ in range(group_size)] for k in keys}


@torch.no_grad()
def update_reference(reference, policy, mode: str, step: int, ema_alpha: float, sync_every: int) -> bool:
    """ema: ref <- (1 - a) ref + a policy every step; periodic: copy every `sync_every` steps; static: never."""
    if mode == "ema":
        for r, p in zip(reference.parameters(), policy.parameters()):
            r.mul_(1.0 - ema_alpha).add_(p.detach(), alpha=ema_alpha)
        return True
    if mode == "periodic" and (step + 1) % sync_every == 0:
        reference.load_state_dict(policy.state_dict())
        return True
    return False


def _atomic_save_final(model, tokenizer, out: Path, provenance: dict[str, Any]) -> None:
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    save_model(model, tokenizer, tmp, extra=provenance)
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)


StepCallback = Callable[[int, Any, dict[str, float]], None]


def train_grpo(cfg: PipelineConfig, paths: Paths = Paths(), callbacks: Sequence[StepCallback] = ()) -> dict[str, Any]:
    """Run GRPO from the SFT (or base) checkpoint; write models/grpo and the step metrics.

    `callbacks(step, policy, metrics)` run after each step (extra evaluation, logging); the rollout
    sampler has its own generator, so whatever they do with global RNGs never shifts training.
    """
    from components.tracking import stage_run

    g = cfg.grpo
    seed_everything(cfg.seed, cfg.threads)
    device = pick_device(cfg.device)
    start_dir = resolve_model_dir(paths.sft_model)
    tokenizer = load_tokenizer(start_dir)
    policy = load_model(start_dir, device).train()
    reference = None
    if g.kl_beta > 0:
        reference = copy.deepcopy(policy).eval().requires_grad_(False)
    records = read_jsonl(split_path(paths.data, "train"))
    rewards = RewardModel(g.rewards)
    schedule = PromptSchedule(len(records), g.prompts_per_step, cfg.seed)
    optimizer = torch.optim.AdamW(policy.parameters(), lr=g.learning_rate, weight_decay=g.weight_decay)
    rollout_gen = torch.Generator(device=device).manual_seed(cfg.seed + 1)
    eps_high = g.epsilon if g.epsilon_high is None else g.epsilon_high

    run_hash = section_hash(g, cfg.seed, dir_md5(start_dir), file_md5(split_path(paths.data, "train")))
    for stale in discard_foreign(paths.grpo_checkpoints, run_hash):
        print(f"grpo: removed checkpoint {stale} (trained from other inputs)")
    start_step, history = 0, []
    resume_from = latest_checkpoint(paths.grpo_checkpoints, run_hash)
    if resume_from is not None:
        state = load_checkpoint(resume_from, policy, optimizer, reference)
        start_step, history = int(state["step"]), list(state["history"])
        rollout_gen.set_state(state["rollout_rng"])
        torch.set_rng_state(state["torch_rng"])
        print(f"grpo: resumed from {resume_from} at step {start_step}/{g.steps}")

    bad_steps = 0
    with stage_run(cfg.tracking.experiment, "grpo", to_flat_dict(cfg)) as run:
        run.set_tags({"grpo.resumed_from_step": start_step})
        started = time.perf_counter()
        for step in range(start_step, g.steps):
            t_step = time.perf_counter()
            lr = learning_rate(step, g)
            for group in optimizer.param_groups:
                group["lr"] = lr
            batch = [records[i] for i in schedule.indices(step)]
            prompts = [r["prompt"] for r in batch]

            t0 = time.perf_counter()
            rollout = sample_groups(policy, tokenizer, prompts, g.group_size, g.max_completion_length,
                                    temperature=g.temperature, top_p=g.top_p, generator=rollout_gen)
            completions = decode_completions(tokenizer, rollout)
            t_gen = time.perf_counter() - t0

            t0 = time.perf_counter()
            scored = rewards([p for p in prompts for _ in range(g.group_size)], completions,
                             reward_columns(batch, g.group_size))
            reward_t = torch.tensor(scored.total, dtype=torch.float32, device=device)
            advantages = group_advantages(reward_t, g.group_size, g.scale_rewards)
            t_reward = time.perf_counter() - t0

            t0 = time.perf_counter()
            ref_logp = None
            if reference is not None:
                with torch.inference_mode():
                    ref_logp = completion_logprobs(reference, rollout, g.temperature)[0].clone()
            old_logp = None
            if g.num_iterations > 1:  # μ=1: the ratio is exactly 1, old log-probs = detached current ones
                with torch.no_grad():
                    old_logp = completion_logprobs(policy, rollout, g.temperature)[0]
            t_ref = time.perf_counter() - t0

            t0 = time.perf_counter()
            mask = rollout.completion_mask
            skipped = 0
            for iteration in range(g.num_iterations):
                logp, logits = completion_logprobs(policy, rollout, g.temperature, return_logits=iteration == 0)
                if iteration == 0:
                    entropy = masked_entropy(logits.detach(), mask)
                    logp_mean = float((logp.detach() * mask).sum() / mask.sum().clamp(min=1))
                out = policy_loss(logp, old_logp if old_logp is not None else logp.detach(), advantages, mask,
                                  loss_type=g.loss_type, epsilon_low=g.epsilon, epsilon_high=eps_high,
                                  importance_sampling_level=g.importance_sampling_level, ref_logp=ref_logp,
                                  beta=g.kl_beta, kl_estimator=g.kl_estimator,
                                  max_completion_length=g.max_completion_length)
                optimizer.zero_grad(set_to_none=True)
                out.loss.backward()
                grad_norm = torch.nn.utils.clip_grad_norm_(policy.parameters(), g.max_grad_norm)
                if not (torch.isfinite(out.loss) and torch.isfinite(grad_norm)):
                    skipped += 1
                    continue
                optimizer.step()
            t_policy = time.perf_counter() - t0
            if skipped:
                bad_steps += 1
                print(f"grpo: step {step}: non-finite loss or gradient, update skipped ({bad_steps} in a row)")
                if bad_steps > MAX_BAD_STEPS:
                    raise StageFailed(f"grpo: more than {MAX_BAD_STEPS} consecutive steps with non-finite loss or "
                                      f"gradients (last at step {step}); last good checkpoint kept in "
                                      f"{paths.grpo_checkpoints}")
            else:
                bad_steps = 0
            if reference is not None:
                update_reference(reference, policy, g.reference.mode, step, g.reference.ema_alpha,
                                 g.reference.sync_every)

            step_seconds = time.perf_counter() - t_step
            grouped = reward_t.view(-1, g.group_size)
            metrics = {
                "loss": float(out.loss.detach()), "pg_loss": float(out.pg_loss), "kl": float(out.kl),
                "reward_mean": float(reward_t.mean()), "reward_std": float(reward_t.std()),
                "advantage_mean": float(advantages.mean()), "logprob_mean": logp_mean,
                "entropy": float(entropy), "completion_length": float(mask.sum(-1).float().mean()),
                "truncated_frac": float(rollout.truncated.float().mean()),
                "zero_std_group_frac": float((grouped.std(dim=1) == 0).float().mean()),
                "grad_norm": float(grad_norm), "learning_rate": lr, "clip_low_frac": float(out.clip_low_frac),
                "clip_high_frac": float(out.clip_high_frac), "step_seconds": step_seconds,
                "completions_per_s": len(completions) / step_seconds, "time/generation": t_gen,
                "time/reward": t_reward, "time/reference": t_ref, "time/policy": t_policy,
            }
            metrics.update({f"reward/{k}/mean": v for k, v in scored.component_means().items()})
            history.append({"step": step + 1, **{k: round(v, 6) for k, v in metrics.items()}})
            run.log_metrics(metrics, step=step + 1, flush=(step + 1) % g.log_every == 0)
            for callback in callbacks:
                callback(step + 1, policy, metrics)
            if (step + 1) % g.log_every == 0 or step + 1 == g.steps:
                done = step + 1 - start_step
                rate = done / (time.perf_counter() - started)
                eta = (g.steps - step - 1) / rate if rate > 0 else float("inf")
                recent = history[-g.log_every:]
                mean_reward = sum(h["reward_mean"] for h in recent) / len(recent)
                print(f"grpo: step {step + 1}/{g.steps} reward {mean_reward:.3f} kl {metrics['kl']:.4f} "
                      f"loss {metrics['loss']:+.4f} | {rate:.2f} steps/s, {metrics['completions_per_s']:.0f} "
                      f"completions/s, ETA {eta:.0f}s", flush=True)
            if g.checkpoint_every and (step + 1) % g.checkpoint_every == 0 and step + 1 < g.steps:
                save_checkpoint(paths.grpo_checkpoints, step + 1, run_hash, policy, optimizer,
                                {"step": step + 1, "rollout_rng": rollout_gen.get_state(),
                                 "history": [{k: v for k, v in h.items() if k not in TIMING_KEYS} for h in history],
                                 "torch_rng": torch.get_rng_state()},
                                reference if g.reference.mode != "static" else None)

        _atomic_save_final(policy, tokenizer, paths.grpo_model, {"stage": "grpo", "run_hash": run_hash,
                                                                   "steps": g.steps, "start": str(start_dir)})
        summary = write_step_outputs(history, paths)
        run.log_metrics({f"final/{k}": v for k, v in summary.items() if isinstance(v, (int, float))})
    return summary


def write_step_outputs(history: list[dict[str, Any]], paths: Paths) -> dict[str, Any]:
    """Per-step CSV (DVC plots) and a small summary JSON (DVC metrics)."""
    paths.plots.mkdir(parents=True, exist_ok=True)
    paths.metrics.mkdir(parents=True, exist_ok=True)
    keys = list(history[-1].keys()) if history else ["step"]  # the last row has every column, timings included
    with (paths.plots / "grpo_steps.csv").open("w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=keys, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(history)
    tail = history[-max(1, len(history) // 10):]
    summary = {"steps": len(history),
               "reward_mean_first10pct": _mean(history[: max(1, len(history) // 10)], "reward_mean"),
               "reward_mean_last10pct": _mean(tail, "reward_mean"), "kl_last": history[-1]["kl"] if history else 0.0}
    (paths.metrics / "grpo.json").write_text(json.dumps(summary, indent=2, sort_keys=True) + "\n")
    return summary


def _mean(rows: list[dict[str, Any]], key: str) -> float:
    return round(sum(r[key] for r in rows) / len(rows), 6) if rows else 0.0


def main(argv: list[str] | None = None) -> int:
    return stage_main("GRPO training.", train_grpo, argv)


if __name__ == "__main__":
    sys.exit(main())
