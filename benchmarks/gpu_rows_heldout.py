"""benchmarks/gpu_rows.py's real-model phases (with `--gguf`, the SmolLM2-135M-Instruct GGUF): the data, the GGUF
converted and the SFT warm start of configs/examples/smollm2_reasoning.yaml, built once by the stages themselves; then
rows on that real model, ours against TRL with EOS on (256 rows of 128 tokens, and 64 rows of up to 512), where rows
finish at different steps as they do in training; then held-out reward after equal completions: the same number of
steps by the pipeline's grpo stage (tracking off) and by TRL's GRPOTrainer (the settings of benchmarks/grpo_vs_trl.py,
bf16 on a GPU) from the warm start, the greedy held-out reward of each on the same prompts and their paired
difference."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
REASONING = "configs/examples/smollm2_reasoning.yaml"
OFF_THE_CLOCK = ["grpo.checkpoint_every=0", "evaluate.every=0"]


def heldout_config(args: argparse.Namespace, extra: list[str] = ()):
    from pipelines.params_io import merged_config

    return merged_config(ROOT / "params.yaml", [ROOT / REASONING],
                         [f"model.name_or_path={args.gguf}", f"device={args.device}", f"model.dtype={args.dtype}",
                          "seed=1", "threads=8", "grpo.prompts_per_step=8", "grpo.group_size=8", *extra,
                          *args.heldout_overrides.split()])  # overrides last: a CPU check shrinks what it must


def build_start(cfg, root: Path) -> None:
    """Data, the GGUF converted and the SFT warm start, by the stages themselves (once per work folder). A
    models/base already in the work folder whose provenance names this GGUF's sha256 is used as it is (a CPU
    rehearsal hands in the conversion its test run already made)."""
    import json

    from components.data.model_source import gguf_source
    from components.data.paths import Paths
    from components.engine.models.gguf_model import file_sha256
    from components.stages.model import build_base_model
    from components.stages.prepare import prepare
    from components.stages.sft import train_sft

    if (root / "models" / "sft").exists():
        return
    paths = Paths(root=root)
    prepare(cfg, paths)
    provenance = paths.base_model / "provenance.json"
    gguf = gguf_source(cfg.model.name_or_path, cfg.model.gguf_file)
    if not (provenance.exists() and gguf is not None
            and json.loads(provenance.read_text()).get("gguf_sha256") == file_sha256(gguf)):
        build_base_model(cfg, paths)
    train_sft(cfg, paths)


def train_trl(cfg, root: Path, steps: int, device: str):
    """TRL's GRPOTrainer from the warm start with the pipeline's settings and reward code; returns its model."""
    import torch
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    from benchmarks.grpo_vs_trl import trl_settings
    from components.data.records import read_jsonl, split_path
    from components.engine.models.modeling import load_model, load_tokenizer
    from components.engine.models.prompting import PromptFormatter
    from components.engine.rewards.rewards import RewardModel

    sft = root / "models" / "sft"
    tokenizer = load_tokenizer(sft)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model = load_model(sft, torch.device(device), dtype).train()
    formatter = PromptFormatter(cfg.prompt, tokenizer)
    records = read_jsonl(split_path(root / "data" / "prepared", "train"))
    dataset = Dataset.from_list([{**{k: v for k, v in r.items() if k != "id"}, "prompt": formatter(r),
                                  "raw_prompt": r["prompt"]} for r in records])
    rewards = RewardModel(cfg.grpo.rewards)

    def task_reward(prompts, completions, raw_prompt, **columns):  # the reward code our engine calls
        return rewards(list(raw_prompt), list(completions), {k: list(v) for k, v in columns.items()
                                                             if isinstance(v, list)}).total

    task_reward.__name__ = cfg.grpo.rewards[0].name
    settings = trl_settings(cfg, steps, root / "trl-out") | {"use_cpu": device != "cuda", "bf16": device == "cuda"}
    peft_config = None
    if cfg.grpo.lora.enabled:
        from peft import LoraConfig

        lora = cfg.grpo.lora
        peft_config = LoraConfig(r=lora.rank, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                                 target_modules=list(lora.target_modules), task_type="CAUSAL_LM")
    trainer = GRPOTrainer(model=model, reward_funcs=task_reward, args=GRPOConfig(**settings), train_dataset=dataset,
                          processing_class=tokenizer, peft_config=peft_config)
    trainer.train()
    return trainer.model


def real_row(args: argparse.Namespace, kind: str, prompts: int, length: int, say=print) -> dict[str, Any]:
    """Ours and TRL taking turns on the real model's SFT warm start, EOS on, the reasoning example's prompts."""
    import torch

    from benchmarks.gpu_long_row import no_tracking
    from benchmarks.gpu_rows_trl import trl_alternating
    from components.data.records import read_jsonl, split_path
    from components.engine.generation.engines.base import SpecialTokens
    from components.engine.models.modeling import load_model, load_tokenizer, resolve_dtype
    from components.engine.models.prompting import PromptFormatter

    root = Path(args.work) / "heldout"
    cfg = heldout_config(args, [*OFF_THE_CLOCK, f"grpo.max_completion_length={length}",
                                f"grpo.prompts_per_step={prompts}"])  # 8 completions a prompt (heldout_config)
    with no_tracking():
        build_start(cfg, root)
    sft, device = root / "models" / "sft", torch.device(args.device)
    tokenizer = load_tokenizer(sft)
    formatter = PromptFormatter(cfg.prompt, tokenizer)
    prompts = cfg.grpo.prompts_per_step  # as TRL's batch has it (a CPU check's overrides may shrink it)
    texts = [formatter(r) for r in read_jsonl(split_path(root / "data" / "prepared", "train"))[:prompts]]
    ids = [tokenizer(t, add_special_tokens=False).input_ids for t in texts]
    dtype = resolve_dtype(cfg.model.dtype, device)
    models = [load_model(sft, device, dtype).train() for _ in range(2)]
    engines = trl_alternating(args, cfg, *models, tokenizer, texts, ids, say, eos_on=True,
                              tokens=SpecialTokens.of(tokenizer))
    ours, trl = engines["ours"], engines["trl"]
    return {"row": kind, "shape": "smollm2-135m (real, SFT warm start)", "mode": "lora", "length": length,
            "rows": prompts * cfg.grpo.group_size, "prompt_tokens": max(len(i) for i in ids), "eos": True,
            "trl_baseline": engines["trl_baseline"], "engines": {"ours": ours, "trl": trl},
            "speedup_vs_trl": round(ours["completion_tokens_per_s"] / trl["completion_tokens_per_s"], 2),
            "generation_speedup_vs_trl": round(ours["generation_tokens_per_s"] / trl["generation_tokens_per_s"], 2)}


def heldout_phases(args: argparse.Namespace) -> list[tuple]:
    """(name, estimate seconds, measure(say)) of the real-model phases, most important first."""
    todo: list[tuple] = []
    if args.wide:
        todo.append(("real 256 rows, EOS on", 60, lambda say: real_row(args, "real-wide", 32, args.wide_length, say)))
    if args.eos_row:
        todo.append((f"real eos, 64 x {args.scale_length}", 45,
                     lambda say: real_row(args, "real-eos", 8, args.scale_length, say)))
    for mode in args.heldout_modes.split(","):
        extra = ["grpo.lora.quantize_base=nf4"] if mode == "lora-nf4" else []
        todo.append((f"heldout after equal completions, {mode}", 120,
                     lambda say, e=extra, m=mode: heldout_row(args, say, e, with_trl=m != "lora-nf4")))
    return todo


def heldout_row(args: argparse.Namespace, say=print, extra: list[str] = (), with_trl: bool = True) -> dict[str, Any]:
    import numpy as np
    import torch

    from benchmarks.gpu_long_row import no_tracking
    from benchmarks.grpo_vs_trl import grpo_run_dir, heldout_evaluator
    from components.data.paths import Paths
    from components.engine.evaluation.heldout import paired_bootstrap
    from components.engine.models.modeling import load_model, load_tokenizer, resolve_dtype
    from components.stages.grpo import train_grpo

    root, steps = Path(args.work) / "heldout", args.heldout_steps
    cfg = heldout_config(args, [*OFF_THE_CLOCK, f"grpo.steps={steps}", f"grpo.log_every={steps}", *extra])
    device = torch.device(args.device)
    with no_tracking():
        build_start(cfg, root)
        sft = root / "models" / "sft"
        evaluate = heldout_evaluator(cfg, root, load_tokenizer(sft), args.heldout)
        start = evaluate(load_model(sft, device, resolve_dtype(cfg.model.dtype, device)))["mean"]
        say(f"  warm start held-out {start:.3f}", flush=True)
        scores: dict[str, dict[str, Any]] = {}

        def on_step(step: int, model, _metrics) -> None:
            if step == steps:
                scores["ours"] = evaluate(model)

        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
        train_grpo(cfg, Paths(root=grpo_run_dir(root, "grpo-ours" + "-nf4" * bool(extra))), callbacks=[on_step])
        peak = torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else None
        if with_trl:
            scores["trl"] = evaluate(train_trl(cfg, root, steps, args.device))
    g = cfg.grpo
    row = {"row": "heldout", "steps": steps, "completions": steps * g.prompts_per_step * g.group_size,
           "n": len(scores["ours"]["rewards"]), "start": round(start, 4), "ours": round(scores["ours"]["mean"], 4),
           "ours_peak_gpu_gb": None if peak is None else round(peak, 2), "trl": None,
           "mode": g.lora.quantize_base if g.lora.quantize_base != "none" else "lora" if g.lora.enabled else "full",
           "max_completion_length": g.max_completion_length}
    if with_trl:
        diff = paired_bootstrap(np.array(scores["ours"]["rewards"]), np.array(scores["trl"]["rewards"]), 10_000, 1)
        row.update(trl=round(scores["trl"]["mean"], 4), ours_minus_trl={k: round(v, 4) for k, v in diff.items()})
    return row
