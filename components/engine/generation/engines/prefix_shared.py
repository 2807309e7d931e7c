"""The prompt-once engine: `fast.PrefixSharedLM` (each prompt encoded once per group, completion tokens packed, LoRA
merged for decoding) behind the rollout door. Models of a family it knows (fast/families.py) only, and only
once its self-check against the Hugging Face forward has passed; `build` returns None (with one line saying why)
otherwise."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from components.engine.generation.engines.base import EngineRun, SamplingParams, SpecialTokens
from components.engine.generation.engines.turns import LoopDecoding
from components.engine.generation.fast.build import checked_prefix_shared_lm
from components.engine.generation.fast.fastlm import PrefixSharedLM
from components.engine.generation.fast.pieces import FastOptions
from components.engine.generation.rollouts import Turn
from components.rollout_engines import PrefixSharing


class PrefixSharedEngine:
    """Samples under `torch.inference_mode` (no autograd bookkeeping; the rollouts are then cloned into ordinary
    tensors, because the loss's forward saves the sampled ids for backward) from a decoder that drops finished rows
    from its caches, and scores with the prompt-once forward."""

    name = "prefix_shared"

    def __init__(self, lm: PrefixSharedLM, tokens: SpecialTokens):
        self.lm, self.tokens = lm, tokens

    def start(self, prompts: Sequence[Sequence[int]], continuing: bool = False) -> LoopDecoding:
        return LoopDecoding(self.lm.start_decoding, prompts, self.tokens, next(self.lm.model.parameters()).device,
                            continuing, torch.inference_mode, clone=True)

    def sample(self, prompts: Sequence[Sequence[int]], params: SamplingParams,
               generator: torch.Generator | None = None) -> Turn:
        return self.start(prompts).turn(params, generator)

    def logprobs(self, rollouts: Turn, temperature: float,
                 with_entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        return self.lm.completion_logprobs(rollouts, temperature, with_entropy)

    def over(self, model: Any) -> PrefixSharedEngine:
        return PrefixSharedEngine(self.lm.over(model), self.tokens)


def build(model: Any, tokens: SpecialTokens, vocab_size: int | None, max_length: int | None, completion_length: int,
          onednn_matmul: bool = True, gradient_checkpointing: bool = False,
          say: Callable[..., None] = print) -> PrefixSharedEngine | None:
    """The checked prompt-once engine over `model`, or None with one line saying why: it can never take training
    down (a transformers release that renames what it reads, a torch op that changed), only make it slower."""
    options = FastOptions(onednn_matmul=onednn_matmul, gradient_checkpointing=gradient_checkpointing)
    try:
        lm = checked_prefix_shared_lm(model, vocab_size, max_length, completion_length, options)
    except Exception as err:  # noqa: BLE001 - whatever broke, the plain forward still works
        say(f"grpo: prefix sharing off: building or checking the prompt-once forward failed ({type(err).__name__}: "
            f"{err}); using the plain Hugging Face forward", flush=True)
        return None
    if lm is None:
        say(f"grpo: prefix sharing off: {type(model).__name__} is not a model of a family the fast path knows "
            "(fast/families.py) with full attention, no attention dropout and log-probs and gradients that match "
            "Hugging Face's; using the plain forward",
            flush=True)
        return None
    return PrefixSharedEngine(lm, tokens)


def build_for_run(model: Any, tokens: SpecialTokens, run: EngineRun, settings: PrefixSharing,
                  say: Callable[..., None] = print) -> PrefixSharedEngine | None:
    """The checked prompt-once engine when `prefix_sharing` is on and the forwards need no wrapper (several
    processes, per-group sampling: those need the wrapped, N-independent forward), else None."""
    if not settings.prefix_sharing or run.wrapped:
        return None
    return build(model, tokens, run.vocab_size, run.max_length, run.completion_length, settings.onednn_matmul,
                 run.gradient_checkpointing, say)


def conformance(model: Any, tokens: SpecialTokens, run: EngineRun) -> PrefixSharedEngine:
    """The checked engine at the default settings; refusing a model the suite gives it is a failure."""
    engine = build_for_run(model, tokens, run, PrefixSharing())
    if engine is None:
        raise RuntimeError(f"the prompt-once engine refused {type(model).__name__}, a model it supports")
    return engine
