"""The model GRPO trains, its reference, and the one door they generate and score through.

`build_policy` loads the model (full weights or LoRA) and, only when the loss has a KL term (`GRPOLoss.uses_reference`),
the reference: a frozen copy (or `grpo.reference.path`), or with LoRA the same model with its adapters switched off.
It decides once, with the step's memory estimate, whether training forwards recompute each layer, and then which
rollout engine samples and scores (`rollout.choose.build_engine`). The algorithm calls `sample`, `logprobs` and
`reference_logprobs`; it never sees which engine runs.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from components.config import ConfigError, LoRAConfig, PipelineConfig
from components.engine.generation.engines.adapters_off import AdaptersOff
from components.engine.generation.engines.base import EngineRun, RolloutEngine, SamplingParams, SpecialTokens
from components.engine.generation.engines.choose import build_engine, plain_engine, through_trainer
from components.engine.generation.rollouts import Rollouts
from components.engine.generation.service import Generation, play_of
from components.engine.grpo.memory_estimate import MemoryFit, fit_memory
from components.engine.models.modeling import load_policy_model, load_tokenizer
from components.rollout_engines import engine_settings


def attach_lora(model, lora: LoRAConfig):
    """Wrap `model` with peft LoRA adapters (float32, applied in a half-precision model's dtype:
    components/engine/models/lora_precision.py); refuse target modules the model does not have."""
    names = {name.rsplit(".", 1)[-1] for name, _ in model.named_modules()}
    missing = [m for m in lora.target_modules if m not in names]
    if missing:
        raise ConfigError(f"grpo.lora.target_modules: {missing} not found in the model "
                          f"(it has e.g. {sorted(n for n in names if n and not n.isdigit())[:12]})")
    from peft import LoraConfig, get_peft_model

    if lora.quantize_base != "none":  # a 4-bit frozen base (QLoRA): before the adapters wrap its projections
        from components.engine.models.quantize import quantize_base

        quantize_base(model, lora.quantize_base)
    from components.engine.models.lora_precision import adapters_in_model_dtype

    adapted = get_peft_model(model, LoraConfig(r=lora.rank, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                                               target_modules=list(lora.target_modules), task_type="CAUSAL_LM"))
    adapters_in_model_dtype(adapted)  # a half-precision model's adapters run in its dtype (kept float32)
    return adapted


def raw_prompt(record: dict[str, Any]) -> str:
    return record["prompt"]


@dataclass(frozen=True)
class Policy:
    """The model being trained, how its rows are generated (`generation`: its engine and play), and the engines that
    score."""

    tokenizer: Any
    model: Any
    generation: Generation  # samples with `engine`: single turns or episodes
    reference: Any | None = None  # a separate frozen model, or None (no KL, or LoRA: adapters disabled)
    reference_engine: RolloutEngine | None = None  # scores with the reference (None: no KL term)
    lora: bool = False
    trainer: Any | None = None  # the module gradient forwards go through (DDP's wrapper); None: `model`
    temperature: float = 1.0  # what `logprobs` and `reference_logprobs` score at: the sampler's (`grpo.temperature`)

    @property
    def engine(self) -> RolloutEngine:
        """Samples and scores with `model`."""
        return self.generation.engine

    @classmethod
    def of(cls, tokenizer: Any, model: Any, engine: RolloutEngine | None = None, reference: Any | None = None,
           lora: bool = False, with_reference: bool = True,
           format_prompt: Callable[[dict[str, Any]], str] = raw_prompt,
           generation: Generation | None = None, temperature: float = 1.0) -> Policy:
        """A policy over `model` with `engine` (default: the plain Hugging Face one) generating single turns of
        `format_prompt` (or `generation` over that engine) and, when `with_reference`, the reference engine that goes
        with it: LoRA's adapters off, or the same engine over `reference`; scoring at `temperature`."""
        engine = engine if engine is not None else plain_engine(model, SpecialTokens.of(tokenizer))
        generation = generation or Generation.single_turn(engine, tokenizer, format_prompt)
        reference_engine = None
        if with_reference and lora:
            reference_engine = AdaptersOff(engine, model)
        elif with_reference and reference is not None:
            reference_engine = engine.over(reference)
        return cls(tokenizer, model, generation.with_engine(engine), reference, reference_engine, lora,
                   temperature=temperature)

    @property
    def train_module(self) -> Any:
        return self.model if self.trainer is None else self.trainer

    def with_trainer(self, trainer: Any) -> Policy:
        """This policy training through `trainer` (DDP's wrapper): only the plain engine, built for wrapped runs,
        forwards through a wrapper."""
        generation = self.generation.with_engine(through_trainer(self.engine, trainer))
        return dataclasses.replace(self, trainer=trainer, generation=generation)

    def sample(self, records: Sequence[dict[str, Any]], params: SamplingParams,
               generator: torch.Generator | None = None) -> Rollouts:
        """`params.n` rows of each record, each played to its end (`Generation.run`)."""
        return self.generation.run(records, params, generator)

    def logprobs(self, rollouts: Rollouts, with_entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Completion log-probs (and entropies) under the policy at its `temperature`; with gradients enabled,
        through the trainer."""
        return self.engine.logprobs(rollouts, self.temperature, with_entropy)

    def reference_logprobs(self, rollouts: Rollouts) -> torch.Tensor:
        """Under inference_mode; cloned outside it so the loss can use the result."""
        if self.reference_engine is None:
            raise ValueError("this policy has no reference (the loss has no KL term)")
        with torch.inference_mode():
            logp = self.reference_engine.logprobs(rollouts, self.temperature)[0]
        return logp.clone()


def build_policy(cfg: PipelineConfig, start_dir: Path, device: torch.device, records: list[dict[str, Any]] | None,
                 with_reference: bool, wrapped: bool = False, stop_together: Callable[[bool], bool] | None = None,
                 say: Callable[..., None] = print) -> tuple[Policy, MemoryFit]:
    """Policy and reference (when `with_reference`); gradient checkpointing decided from the step's memory estimate
    (`memory_estimate.fit_memory`, returned beside the policy); then the engine (`wrapped`: several processes, whose
    forwards must go through their wrapper or be the same for any process count; `stop_together`: a sharded model's
    lockstep decoding).
    `records` size the memory estimate and the engine (the longest row they can make: prompt, tool schemas, turns and
    answers)."""
    g = cfg.grpo
    tokenizer = load_tokenizer(start_dir, cfg.model.trust_remote_code)
    model = load_policy_model(cfg, start_dir, device)
    reference = None
    if g.lora.enabled:
        model = attach_lora(model, g.lora)  # the reference is this model with its adapters off
    elif with_reference:
        reference = load_policy_model(cfg, g.reference.path, device) if g.reference.path else copy.deepcopy(model)
        reference.eval().requires_grad_(False)
    play = play_of(cfg, tokenizer)  # single turns or episodes: the engine is sized from it
    longest_prompt = play.longest_prompt(records or [])  # once: an environment's play resets one per record
    memory = fit_memory(g, model, longest_prompt, reference is not None, say)
    run = EngineRun(vocab_size=len(tokenizer), max_length=longest_prompt + g.max_completion_length if records else None,
                    completion_length=g.max_completion_length, gradient_checkpointing=memory.gradient_checkpointing,
                    wrapped=wrapped, stop_together=stop_together)
    engine = build_engine(model.train(), SpecialTokens.of(tokenizer), run, engine_settings(g), say)
    policy = Policy.of(tokenizer, model, engine, reference, g.lora.enabled, with_reference,
                       generation=Generation(engine, play, tokenizer), temperature=g.temperature)
    return policy, memory


@torch.no_grad()
def update_reference(reference, policy, mode: str, step: int, ema_alpha: float, sync_every: int) -> bool:
    """ema: ref <- (1 - a) ref + a policy every step; periodic: copy every `sync_every` steps; static: never."""
    for module in (reference, policy):
        if hasattr(module, "reshard"):  # fsdp2: a root may stay gathered after forward; work on the shards
            module.reshard()
    if mode == "ema":
        for r, p in zip(reference.parameters(), policy.parameters()):
            r.mul_(1.0 - ema_alpha).add_(p.detach(), alpha=ema_alpha)
        return True
    if mode == "periodic" and (step + 1) % sync_every == 0:
        reference.load_state_dict(policy.state_dict())
        return True
    return False
