"""Stage `sft`: optional supervised warm start, cross-entropy on answer tokens (+ EOS) only.

When `sft.enabled` is false it records a pointer to the base model, so later stages always read
models/sft.
"""

from __future__ import annotations

import itertools
import json
import math
import sys
import time

import torch

from components.config import PipelineConfig, to_flat_dict
from components.data.paths import Paths
from components.data.records import iter_jsonl, read_jsonl, split_path
from components.engine.evaluation.task_metrics import generate
from components.engine.generation.engines.base import RolloutEngine, SamplingParams, SpecialTokens
from components.engine.generation.engines.choose import evaluation_engine, plain_engine, through_trainer
from components.engine.generation.rollouts import Turn, left_pad
from components.engine.generation.scoring import score
from components.engine.generation.service import conversation_encoder, for_evaluation
from components.engine.models.modeling import (
    load_policy_model,
    load_tokenizer,
    pick_device,
    save_model,
    seed_everything,
    write_pointer,
)
from components.engine.models.optim import cosine_learning_rate, make_optimizer, set_learning_rate
from components.engine.models.prompting import PromptFormatter
from components.engine.parallel.distributed import (
    DistContext,
    all_reduce_sum,
    all_true,
    init,
    launch,
    needs_launch,
    shutdown,
    wrap_ddp,
)
from components.engine.rewards.rewards import RewardError, RewardModel
from components.rollout_engines import engine_settings
from components.stages.cli import stage_main
from components.tracking.runs import tracking_run


def encode_sft(tokenizer, records: list[dict], format_prompt=lambda r: r["prompt"], target: str = "answer",
               conversation=None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded input ids, attention mask, and labels with prompt and padding set to -100.
    `target`: the column learned after the prompt (+ EOS). A target holding a worked conversation (a list of
    messages: assistant turns, tool results between them) is laid out by `conversation(record, turns)` as an episode
    is, and only the model's turns are learned."""
    rows, labels = [], []
    for r in records:
        if conversation is not None and isinstance(r[target], list):
            ids, written = conversation(r, r[target])
            rows.append(ids)
            labels.append([t if w else -100 for t, w in zip(ids, written)])
            continue
        prompt = tokenizer(format_prompt(r), add_special_tokens=False).input_ids
        answer = tokenizer(str(r[target]), add_special_tokens=False).input_ids + [tokenizer.eos_token_id]
        rows.append(prompt + answer)
        labels.append([-100] * len(prompt) + answer)
    width = max(map(len, rows))
    ids = torch.full((len(rows), width), tokenizer.pad_token_id, dtype=torch.long)
    lab = torch.full((len(rows), width), -100, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, (row, label) in enumerate(zip(rows, labels)):
        ids[i, : len(row)], lab[i, : len(row)], mask[i, : len(row)] = torch.tensor(row), torch.tensor(label), 1
    return ids, mask, lab


def train_sft(cfg: PipelineConfig, paths: Paths = Paths()) -> dict:
    """Warm start; with `distributed.nproc > 1` under torchrun, each rank takes a share of every batch."""
    s = cfg.sft
    paths.metrics.mkdir(parents=True, exist_ok=True)
    if not s.enabled:
        write_pointer(paths.sft_model, str(paths.base_model))
        summary = {"enabled": False}
        (paths.metrics / "sft.json").write_text(json.dumps(summary) + "\n")
        print("sft: disabled; GRPO starts from the base model")
        return summary
    if needs_launch(cfg.distributed):
        launch("components.stages.sft", cfg, paths.root)
        return json.loads((paths.metrics / "sft.json").read_text())
    ctx = init(cfg.distributed, pick_device(cfg.device))
    try:
        return _train_sft(cfg, paths, ctx)
    finally:
        shutdown(ctx)


def _demonstrations(cfg: PipelineConfig, paths: Paths, tokenizer) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The SFT split encoded (`encode_sft`); a worked conversation is laid out as the run's episodes are."""
    return encode_sft(tokenizer, read_jsonl(split_path(paths.data, "sft")), PromptFormatter(cfg.prompt, tokenizer),
                      cfg.sft.target_column, conversation_encoder(cfg, tokenizer))


def demonstration_rollouts(ids: torch.Tensor, mask: torch.Tensor, labels: torch.Tensor, rows: torch.Tensor,
                           pad_id: int) -> Turn:
    """Rows of right-padded demonstrations (`encode_sft`) as the rollouts every engine scores: a row's tokens before
    its first learned one are its prompt (left-padded), the rest its completion (right-padded), the learned tokens
    the model's (`model_mask`: a worked conversation's tool answers stay in the context, out of the loss). Widths
    are those of these rows, so a batch pays for its own longest row, not the data's. Column 0 is never learned (no
    position predicts it), as in next-token cross-entropy."""
    prompts, completions, learned = [], [], []
    for r in rows.tolist():
        length = int(mask[r].sum())
        targets = (labels[r, 1:length] != -100).nonzero()
        first = int(targets[0]) + 1 if len(targets) else length - 1  # no learned token: nothing scored
        prompts.append(ids[r, :first].tolist())
        completions.append(ids[r, first:length].tolist())
        learned.append((labels[r, first:length] != -100).long())
    prompt_ids, prompt_mask = left_pad(prompts, pad_id, ids.device)
    width = max(len(c) for c in completions)
    completion_ids = torch.full((len(completions), width), pad_id, dtype=torch.long, device=ids.device)
    completion_mask = torch.zeros_like(completion_ids)
    model_mask = torch.zeros_like(completion_ids)
    for i, (tokens, scored) in enumerate(zip(completions, learned)):
        completion_ids[i, :len(tokens)] = torch.tensor(tokens, dtype=torch.long)
        completion_mask[i, :len(tokens)] = 1
        model_mask[i, :len(tokens)] = scored
    return Turn(prompt_ids, prompt_mask, completion_ids, completion_mask,
                    torch.zeros(len(completions), dtype=torch.bool, device=ids.device), model_mask=model_mask)


def learned_loss_sum(engine: RolloutEngine, batch: Turn) -> tuple[torch.Tensor, float]:
    """(summed cross-entropy of the learned tokens, their count), through the engine's log-probs: the prompt-once
    engine encodes a prefix the rows share (a system prompt, a tool schema) once and feeds no padding through its
    projections; the plain one is Hugging Face's forward."""
    logp, _ = engine.logprobs(batch, 1.0)
    learned = batch.written
    return -(logp * learned).sum(), float(learned.sum())


def sft_engine(cfg: PipelineConfig, model, trainer, tokenizer, mask: torch.Tensor, labels: torch.Tensor,
               ctx: DistContext) -> RolloutEngine:
    """The engine SFT's forwards go through: a sharded model's own forward (FSDP2), DDP's wrapper with several
    processes, else the engine held-out evaluation uses (prompt-once where its self-check on rows as long as the
    longest demonstration passes; SFT's stop check then reuses it)."""
    tokens = SpecialTokens.of(tokenizer)
    if ctx.lockstep:
        return plain_engine(model, tokens)
    if ctx.active:
        return through_trainer(plain_engine(model, tokens), trainer)
    lengths = mask.sum(-1)
    completion = int((lengths - (labels != -100).long().argmax(-1)).max())  # from the first learned token on
    return evaluation_engine(model, tokenizer, completion, int(lengths.max()), engine_settings(cfg.grpo))


def batch_loss(engine: RolloutEngine, ids: torch.Tensor, mask: torch.Tensor, labels: torch.Tensor,
               idx: torch.Tensor, pad_id: int, ctx: DistContext) -> tuple[torch.Tensor, float]:
    """(loss to backpropagate, the batch's mean token loss). One process: mean cross-entropy of the learned tokens.

    With several ranks each takes rows idx[rank::world]; its token-loss sum is divided by the whole
    batch's learned-token count and multiplied by the world size (DDP averages gradients), so the
    update equals the one-process update on the same batch.
    """
    if not ctx.active:
        total, count = learned_loss_sum(engine, demonstration_rollouts(ids, mask, labels, idx, pad_id))
        loss = total / max(count, 1.0)
        return loss, loss.item()
    n_tokens = float((labels[idx][:, 1:] != -100).sum())
    mine = idx[ctx.rank::ctx.world]
    rows, weight = (mine, 1.0) if len(mine) else (idx[:1], 0.0)  # no rows here: a zero loss keeps DDP in step
    total, _ = learned_loss_sum(engine, demonstration_rollouts(ids, mask, labels, rows, pad_id))
    local = total * weight / max(n_tokens, 1.0)
    return local * ctx.world, all_reduce_sum(ctx, [local.item()])[0]


class WarmStartCheck:
    """Greedy mean reward on a fixed set of GRPO training prompts: when it reaches `sft.stop_at_reward`,
    SFT stops. A warm start stopped at a reward, not after a number of steps, lands in the same band
    whatever the CPU's rounding or the seed (a fixed budget sat on a knife edge: a good warm start on one CPU,
    almost none on another). Every rank computes the same number from the same weights, so all stop together."""

    def __init__(self, cfg: PipelineConfig, paths: Paths, tokenizer):
        # The first check_prompts records only: a large training file is not read whole for them.
        self.records = [r for _, r in itertools.islice(iter_jsonl(split_path(paths.data, "train")),
                                                       cfg.sft.check_prompts)]
        self.rewards = RewardModel(cfg.grpo.rewards)
        self.cfg, self.tokenizer, self.max_new_tokens = cfg, tokenizer, cfg.grpo.max_completion_length

    def __call__(self, model, stop_together=None) -> float:
        """`stop_together`: with a sharded (FSDP) model every rank decodes the same prompts in lockstep. Generated
        as held-out evaluation generates (with tools, the check plays episodes)."""
        generation = for_evaluation(self.cfg, model, self.tokenizer, self.max_new_tokens, self.records, stop_together)
        out = generate(generation, model, self.records, SamplingParams(max_new_tokens=self.max_new_tokens,
                                                                       greedy=True), 256)
        try:
            scores = score(self.rewards, self.records, out).total
        except RewardError as err:  # said with where it happened: SFT's stop check, not GRPO
            raise RewardError(f"{err} (in SFT's stop check, sft.stop_at_reward)") from err
        return sum(scores) / len(scores)


def _train_sft(cfg: PipelineConfig, paths: Paths, ctx: DistContext) -> dict:
    s = cfg.sft
    seed_everything(cfg.seed, cfg.threads)
    device = ctx.device
    tokenizer = load_tokenizer(paths.base_model, cfg.model.trust_remote_code)
    # fsdp2: load whole on the CPU; fully_shard moves each rank's shards to its device.
    model = load_policy_model(cfg, paths.base_model, torch.device("cpu") if ctx.lockstep else device).train()
    if ctx.lockstep:
        from components.engine.parallel.fsdp import shard_model

        shard_model(model, ctx)
    ids, mask, labels = (t.to(device) for t in _demonstrations(cfg, paths, tokenizer))
    n = ids.shape[0]
    steps_per_epoch = math.ceil(n / s.batch_size)
    total = steps_per_epoch * s.epochs
    optimizer = make_optimizer(model, s.learning_rate, s.weight_decay, device, fused=False)
    gen = torch.Generator().manual_seed(cfg.seed + 2)
    trainer = model if ctx.lockstep else wrap_ddp(model, ctx)
    engine = sft_engine(cfg, model, trainer, tokenizer, mask, labels, ctx)
    check = WarmStartCheck(cfg, paths, tokenizer) \
        if s.stop_at_reward is not None else None
    check_reward, stopped = None, False
    lockstep = (lambda done: all_true(ctx, done)) if ctx.lockstep else None
    started = time.perf_counter()
    with tracking_run(ctx.is_main, cfg.tracking.experiment, "sft", to_flat_dict(cfg)) as run:
        step = 0
        for epoch in range(s.epochs):
            order = torch.randperm(n, generator=gen).to(device)
            epoch_loss = 0.0
            for start in range(0, n, s.batch_size):
                idx = order[start: start + s.batch_size]
                loss, loss_value = batch_loss(engine, ids, mask, labels, idx, tokenizer.pad_token_id, ctx)
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                set_learning_rate(optimizer, cosine_learning_rate(step, total, s.learning_rate, floor_ratio=0.1))
                optimizer.step()
                step += 1
                epoch_loss += loss_value * len(idx)
                if check is not None and step % s.check_every == 0:
                    check_reward = check(model, lockstep)
                    run.log_metrics({"check_reward": check_reward}, step=step, flush=False)
                    if check_reward >= s.stop_at_reward:
                        stopped = True
                        seen = start + len(idx)
                        epoch_loss *= n / seen  # the mean over the part of the epoch that ran
                        break
            run.log_metrics({"loss": epoch_loss / n}, step=epoch + 1, flush=False)
            if stopped:
                if ctx.is_main:
                    print(f"sft: stopped at step {step}/{total} (epoch {epoch + 1}): greedy reward {check_reward:.3f} "
                          f"on {len(check.records)} training prompts reached sft.stop_at_reward "
                          f"{s.stop_at_reward}", flush=True)
                break
            if ctx.is_main and ((epoch + 1) % max(1, s.epochs // 5) == 0 or epoch + 1 == s.epochs):
                rate = step / (time.perf_counter() - started)
                print(f"sft: epoch {epoch + 1}/{s.epochs} loss {epoch_loss / n:.4f} | {rate:.1f} steps/s, "
                      f"ETA {(total - step) / rate:.0f}s", flush=True)
        summary = {"enabled": True, "final_loss": round(epoch_loss / n, 6), "examples": n, "steps": step}
        if check is not None:
            if check_reward is None or not stopped:  # never reached: the last weights' figure
                check_reward = check(model, lockstep)
            summary.update(check_reward=round(check_reward, 6), stopped_early=stopped)
            if not stopped and check_reward < s.stop_at_reward and ctx.is_main:
                print(f"sft: warning: greedy reward {check_reward:.3f} after all {s.epochs} epochs is below "
                      f"sft.stop_at_reward {s.stop_at_reward}: the warm start is weaker than intended "
                      "(more epochs or another sft.learning_rate)", flush=True)
        run.log_metrics({"final_loss": epoch_loss / n})
    if ctx.lockstep:  # gathered whole; rank 0 saves a normal HF directory
        from components.engine.parallel.fsdp import full_model_state, plain_copy

        weights = full_model_state(model)
        if ctx.is_main:
            model = plain_copy(lambda: load_policy_model(cfg, paths.base_model, torch.device("cpu")), weights)
    if not ctx.is_main:
        return summary
    save_model(model, tokenizer, paths.sft_model, extra={"stage": "sft", "steps": step})
    (paths.metrics / "sft.json").write_text(json.dumps(summary, indent=2, sort_keys=True) + "\n")
    return summary


def main(argv: list[str] | None = None) -> int:
    return stage_main("Supervised warm start.", train_sft, argv)


if __name__ == "__main__":
    sys.exit(main())
