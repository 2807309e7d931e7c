"""The model GRPO trains and its reference: build them (full weights or LoRA), get log-probs, move the reference.

The reference exists only when the loss has a KL term (`GRPOLoss.uses_reference`): a frozen copy
(or `grpo.reference.path`), or with LoRA the same model with its adapters switched off.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from components.config import ConfigError, LoRAConfig, PipelineConfig
from components.engine.fast.fastlm import PrefixSharedLM
from components.engine.models.modeling import layer_checkpointing, load_policy_model, load_tokenizer
from components.engine.models.prompting import PromptFormatter
from components.engine.models.rollout import Rollout, completion_logprobs


def attach_lora(model, lora: LoRAConfig):
    """Wrap `model` with peft LoRA adapters; refuse target modules the model does not have."""
    names = {name.rsplit(".", 1)[-1] for name, _ in model.named_modules()}
    missing = [m for m in lora.target_modules if m not in names]
    if missing:
        raise ConfigError(f"grpo.lora.target_modules: {missing} not found in the model "
                          f"(it has e.g. {sorted(n for n in names if n and not n.isdigit())[:12]})")
    from peft import LoraConfig, get_peft_model

    return get_peft_model(model, LoraConfig(r=lora.rank, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                                            target_modules=list(lora.target_modules), task_type="CAUSAL_LM"))


@dataclass
class Policy:
    """The model being trained and how to get reference log-probs for it."""

    tokenizer: Any
    model: Any
    reference: Any | None  # a separate frozen model, or None (no KL, or LoRA: adapters disabled)
    lora: bool
    format_prompt: Callable[[dict[str, Any]], str] = lambda record: record["prompt"]
    fast: PrefixSharedLM | None = None  # prompt-once forwards over `model` (None: plain Hugging Face forward)
    fast_reference: PrefixSharedLM | None = None
    trainer: Any | None = None  # the module gradient forwards go through (DDP wrapper); default `model`
    gradient_checkpointing: bool = False  # training forwards recompute each decoder layer in backward

    def set_gradient_checkpointing(self, enabled: bool) -> None:
        """Recompute each decoder layer in backward from now on (the prefix-shared and the plain forward alike)."""
        self.gradient_checkpointing = enabled
        if self.fast is not None:
            self.fast.gradient_checkpointing = enabled

    @property
    def train_module(self):
        return self.model if self.trainer is None else self.trainer

    def logprobs(self, rollout: Rollout, temperature: float, with_entropy: bool = False,
                 module: Any | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Completion log-probs (and entropies) through `module` (default: `model`), prompt-once when `fast` is set.

        Distributed runs clear `fast`: DDP and FSDP need every forward to go through their wrapper.
        """
        if self.fast is not None:
            return self.fast.completion_logprobs(rollout, temperature, with_entropy)
        with layer_checkpointing(self.model, self.gradient_checkpointing):
            return completion_logprobs(self.model if module is None else module, rollout, temperature, with_entropy)

    def reference_logprobs(self, rollout: Rollout, temperature: float) -> torch.Tensor:
        """Once per rollout under inference_mode; cloned outside it so the loss can use the result."""
        with torch.inference_mode():
            if self.lora:
                with self.model.disable_adapter():
                    logp = self.logprobs(rollout, temperature)[0]
            elif self.fast_reference is not None:
                logp = self.fast_reference.completion_logprobs(rollout, temperature)[0]
            else:
                logp = completion_logprobs(self.reference, rollout, temperature)[0]
        return logp.clone()


def longest_row(tokenizer: Any, format_prompt: Callable[[dict[str, Any]], str], records: list[dict[str, Any]],
                completion_length: int) -> int:
    """Tokens in the longest prompt + completion row GRPO will see (the prompt-once forward checks that long)."""
    longest = max((len(tokenizer(format_prompt(r), add_special_tokens=False).input_ids) for r in records), default=1)
    return longest + completion_length


def build_policy(cfg: PipelineConfig, start_dir: Path, device: torch.device, records: list[dict[str, Any]] | None,
                 with_reference: bool, fast: bool = True, say=print) -> Policy:
    """Policy, reference (when `with_reference`) and, with `fast` and `grpo.prefix_sharing`, the prompt-once
    forwards (decided here, once: several processes need every forward through their wrapper, so they pass
    `fast=False`); `records` size the fast path's self-check."""
    g = cfg.grpo
    tokenizer = load_tokenizer(start_dir, cfg.model.trust_remote_code)
    model = load_policy_model(cfg, start_dir, device)
    reference = None
    if g.lora.enabled:
        model = attach_lora(model, g.lora)  # the reference is this model with its adapters off
    elif with_reference:
        reference = load_policy_model(cfg, g.reference.path, device) if g.reference.path else copy.deepcopy(model)
        reference.eval().requires_grad_(False)
    policy = Policy(tokenizer, model.train(), reference, g.lora.enabled, PromptFormatter(cfg.prompt, tokenizer))
    if g.prefix_sharing and fast:
        max_length = longest_row(tokenizer, policy.format_prompt, records, g.max_completion_length) if records else None
        policy.fast = fast_path(model, len(tokenizer), max_length, g.max_completion_length, g.onednn_matmul, say)
        if policy.fast is not None and reference is not None:
            policy.fast_reference = policy.fast.for_same_architecture(reference)
    policy.set_gradient_checkpointing(g.gradient_checkpointing == "always")  # "auto": the stage decides
    return policy


def fast_path(model: Any, vocab_size: int, max_length: int | None, completion_length: int, onednn_matmul: bool,
              say=print) -> PrefixSharedLM | None:
    """The checked prompt-once forward over `model`, or None with one line saying why: it can never take training
    down (a transformers release that renames what it reads, a torch op that changed), only make it slower."""
    try:
        fast = PrefixSharedLM.for_model(model, vocab_size, max_length, completion_length, onednn_matmul)
    except Exception as err:  # noqa: BLE001 - whatever broke, the plain forward still works
        say(f"grpo: prefix sharing off: building or checking the prompt-once forward failed ({type(err).__name__}: "
            f"{err}); using the plain Hugging Face forward", flush=True)
        return None
    if fast is None:
        say(f"grpo: prefix sharing off: {type(model).__name__} is not a Llama-family model with full attention, no "
            "attention dropout and log-probs and gradients that match Hugging Face's; using the plain forward",
            flush=True)
    return fast


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
