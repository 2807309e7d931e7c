"""benchmarks/gpu_rows.py's TRL side: TRL's GRPOTrainer and this pipeline taking turns step by step in one process on
the same card (TRL's loop calls ours between its steps; the first step of each is a warm-up).

TRL runs with the settings benchmarks/grpo_vs_trl.py gives it from the same pipeline config (`trl_settings`), at its
best on a card without vLLM (not installable on these machines): bf16 weights, no gradient checkpointing, one
generation batch of every completion, and generation by transformers' continuous batching (`generate_batch`, paged
attention: TRL's `use_transformers_continuous_batching`) where the card's transformers has it (5.8 and later), else
Hugging Face `generate` over a padded batch. Which one ran is named in the row (`trl_baseline`); if continuous
batching fails before TRL's first step, the row falls back to `generate` and says why. TRL's completion tokens are
counted from the completion mask its own step builds, not assumed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from benchmarks.gpu_rows_ours import Clock, Ours, peak_memory, reset_peak, summary


def continuous_batching_available() -> bool:
    import transformers
    from packaging.version import Version

    return Version(transformers.__version__) >= Version("5.8.0")


def baseline_name(continuous: bool) -> str:
    import transformers
    import trl

    how = ("transformers continuous batching (generate_batch, paged attention)" if continuous
           else "Hugging Face generate, one padded batch")
    return f"TRL {trl.__version__} GRPOTrainer; generation: {how}, transformers {transformers.__version__}"


def _settings(cfg, work: Path, rounds: int, device, continuous: bool, eos_on: bool) -> dict[str, Any]:
    from benchmarks.grpo_vs_trl import trl_settings

    g = cfg.grpo
    settings = trl_settings(cfg, rounds, work / "trl-out") | dict(
        use_cpu=device.type == "cpu", bf16=device.type == "cuda", fp16=False, gradient_checkpointing=False,
        generation_kwargs={} if eos_on else {"min_new_tokens": g.max_completion_length}, logging_steps=1000,
        lr_scheduler_type="constant", lr_scheduler_kwargs={}, warmup_steps=0)
    if continuous:
        settings["use_transformers_continuous_batching"] = True
    return settings


def trl_alternating(args, cfg, model_ours, model_trl, tokenizer, prompt_texts: list[str], prompt_ids, say,
                    continuous: bool | None = None, eos_on: bool = False, tokens: Any = None) -> dict[str, Any]:
    """TRL's GRPOTrainer for `args.rounds` steps; after each of its steps one step of ours (timed apart). Every
    completion at the budget unless `eos_on` (then both stop rows at EOS, `tokens.eos_id` for ours). Returns
    {"ours": summary, "trl": summary, "trl_baseline": name}."""
    if continuous is None:
        continuous = args.trl_generation == "continuous" or (
            args.trl_generation == "auto" and args.device == "cuda" and continuous_batching_available())
    try:
        return _alternate(args, cfg, (model_ours, model_trl), tokenizer, prompt_texts, prompt_ids, say, continuous,
                          eos_on, tokens)
    except _BeforeFirstStep as err:
        if not continuous:
            raise err.__cause__ from None
        say(f"  TRL with continuous batching failed before its first step ({err}); again with generate", flush=True)
        result = _alternate(args, cfg, (model_ours, model_trl), tokenizer, prompt_texts, prompt_ids, say, False,
                            eos_on, tokens)
        result["trl_baseline"] += f" (continuous batching failed: {err})"
        return result


class _BeforeFirstStep(RuntimeError):
    """TRL failed before completing a step (nothing measured yet: another generation path may be tried)."""


def _alternate(args, cfg, models, tokenizer, prompt_texts, prompt_ids, say, continuous: bool, eos_on: bool,
               tokens: Any) -> dict[str, Any]:
    import torch
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    device, g = torch.device(args.device), cfg.grpo
    model_ours, model_trl = models
    longest = max(len(p) for p in prompt_ids)
    ours = Ours(model_ours, cfg, len(tokenizer), longest, device, args.engine_mode, tokens=tokens, say=say)
    clock, counters = Clock(device), {"generation": 0.0, "tokens": 0, "start": 0.0}
    steps: dict[str, list[dict[str, Any]]] = {"ours": [], "trl": []}
    peft_config = None
    if g.lora.enabled:
        from peft import LoraConfig

        peft_config = LoraConfig(r=g.lora.rank, lora_alpha=g.lora.alpha, lora_dropout=g.lora.dropout,
                                 target_modules=list(g.lora.target_modules), task_type="CAUSAL_LM")

    def reward(completions, **_):
        return [0.0] * len(completions)  # speed rows: the update runs whatever the advantages

    trainer = GRPOTrainer(model=model_trl, reward_funcs=reward,
                          args=GRPOConfig(**_settings(cfg, Path(args.work), args.rounds, device, continuous, eos_on)),
                          train_dataset=Dataset.from_list([{"prompt": p} for p in prompt_texts * args.rounds]),
                          processing_class=tokenizer, peft_config=peft_config)
    generate, score = trainer._generate, trainer._generate_and_score_completions

    def timed_generate(*a, **kw):
        t0 = clock()
        try:
            return generate(*a, **kw)
        finally:
            counters["generation"] += clock() - t0

    def counted(*a, **kw):
        out = score(*a, **kw)
        counters["tokens"] += int(out["completion_mask"].sum())  # what TRL's own step trains on
        return out

    trainer._generate, trainer._generate_and_score_completions = timed_generate, counted

    class Turns(TrainerCallback):
        def on_step_begin(self, *_a, **_k):
            counters.update(generation=0.0, tokens=0)
            reset_peak()
            counters["start"] = clock()

        def on_step_end(self, *_a, **_k):
            seconds = clock() - counters["start"]
            steps["trl"].append({"generation_s": counters["generation"], "reference_s": 0.0,
                                 "update_s": seconds - counters["generation"], "step_s": seconds,
                                 "tokens": counters["tokens"], **peak_memory()})
            steps["ours"].append(ours.step(prompt_ids, ignore_eos=not eos_on))
            say(f"  round {len(steps['trl'])}/{args.rounds}: TRL {counters['tokens'] / seconds:,.0f} tokens/s "
                f"({counters['tokens']} tokens), ours {steps['ours'][-1]['tokens'] / steps['ours'][-1]['step_s']:,.0f}"
                " tokens/s", flush=True)

    trainer.add_callback(Turns())
    try:
        trainer.train()
    except Exception as err:
        if not steps["trl"]:
            raise _BeforeFirstStep(f"{type(err).__name__}: {str(err).splitlines()[0][:200] if str(err) else ''}") \
                from err
        raise
    return {"ours": {**summary(steps["ours"]), "engine": ours.engine_name, "mode": ours.mode,
                     "gradient_checkpointing": ours.checkpointing},
            "trl": summary(steps["trl"]), "trl_baseline": baseline_name(continuous)}
