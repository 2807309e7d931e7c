"""Which rollout engine runs: decided here, once, when the policy (or an evaluation's generation) is built, from its
settings and device. The only module outside each engine's own that names a concrete engine."""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from components.engine.rollout import cuda_graphs, prefix_shared
from components.engine.rollout.base import RolloutEngine, SpecialTokens
from components.engine.rollout.hf import HFEngine


@dataclass(frozen=True)
class EngineSettings:
    """What the choice and the engines read (from `grpo.*` and the run's data)."""

    prefix_sharing: bool = True  # `grpo.prefix_sharing`: the prompt-once engine where it checks out
    cuda_graphs: bool = True  # `grpo.cuda_graphs`: on a CUDA device, its decoding captured as CUDA graphs
    onednn_matmul: bool = True  # `grpo.onednn_matmul`
    gradient_checkpointing: bool = False  # training forwards recompute each layer in backward
    vocab_size: int | None = None  # the tokenizer's (the self-check draws ids below it)
    max_length: int | None = None  # the longest prompt + completion row the run will see (None: the context)
    completion_length: int = 4  # `grpo.max_completion_length`
    wrapped: bool = False  # forwards must go through a wrapper (DDP, FSDP2) or be the same for any process count
    stop_together: Callable[[bool], bool] | None = None  # sharded models decode in lockstep (FSDP2)


_SAID: weakref.WeakKeyDictionary[Any, set[str]] = weakref.WeakKeyDictionary()


def _once(say: Callable[..., None], model: Any) -> Callable[..., None]:
    """`say`, except for a line already said about `model` (training's engine and the held-out probe's over the same
    model fall back for the same reason: one line)."""
    said = _SAID.setdefault(model, set())

    def said_once(*args: Any, **kwargs: Any) -> None:
        text = " ".join(map(str, args))
        if text not in said:
            said.add(text)
            say(*args, **kwargs)

    return said_once


def build_engine(model: Any, tokens: SpecialTokens, settings: EngineSettings,
                 say: Callable[..., None] = print) -> RolloutEngine:
    """The prompt-once engine when prefix sharing is on, the forwards need no wrapper and its self-check passes
    (else one line says why, once a model), decoding with CUDA graphs on a CUDA device where a trial capture works
    (else one line says why); otherwise the plain Hugging Face engine."""
    say = _once(say, model)
    if settings.prefix_sharing and not settings.wrapped:
        engine = prefix_shared.build(model, tokens, settings.vocab_size, settings.max_length,
                                     settings.completion_length, settings.onednn_matmul,
                                     settings.gradient_checkpointing, say)
        if engine is not None and settings.cuda_graphs and next(model.parameters()).device.type == "cuda":
            return cuda_graphs.build(engine, settings.max_length, say) or engine
        if engine is not None:
            return engine
    return HFEngine(model, tokens, gradient_checkpointing=settings.gradient_checkpointing,
                    stop_together=settings.stop_together)


def plain_engine(model: Any, tokens: SpecialTokens) -> RolloutEngine:
    """The plain Hugging Face engine over `model` (tests and tools that build a policy by hand)."""
    return HFEngine(model, tokens)


def through_trainer(engine: RolloutEngine, trainer: Any) -> RolloutEngine:
    """`engine` with gradient forwards through `trainer` (DDP's wrapper): only the plain engine, built for wrapped
    runs, forwards through a wrapper."""
    if not isinstance(engine, HFEngine):
        raise TypeError(f"a wrapped model trains through the plain engine, not {engine.name!r}")
    return engine.with_trainer(trainer)


_EVALUATION_ENGINES: weakref.WeakKeyDictionary[Any, tuple[int, RolloutEngine]] = weakref.WeakKeyDictionary()


def evaluation_engine(model: Any, tokenizer: Any, completion_length: int, max_length: int,
                      say: Callable[..., None] = print, stop_together: Callable[[bool], bool] | None = None,
                      prefix_sharing: bool = True) -> RolloutEngine:
    """The engine held-out evaluation, pass@k and SFT's stop check run on: the prompt-once engine where its
    self-check on rows of `max_length` tokens passes, else the plain Hugging Face one (always for a sharded model,
    which decodes in lockstep: `stop_together`, and with `grpo.prefix_sharing` off).

    The self-check (forwards and backwards of rows that long) runs once per model object and row length: SFT's stop
    check and the held-out probe during GRPO evaluate the same model, whose weights change but whose structure does
    not. It compares gradients, so it runs with them on, whatever the caller's mode; it writes no `.grad`."""
    if stop_together is not None or not prefix_sharing:
        return HFEngine(model, SpecialTokens.of(tokenizer), stop_together=stop_together)
    cached = _EVALUATION_ENGINES.get(model)
    if cached is not None and cached[0] >= max_length:
        return cached[1]
    settings = EngineSettings(vocab_size=len(tokenizer), max_length=max_length, completion_length=completion_length)
    with torch.enable_grad():
        engine = build_engine(model, SpecialTokens.of(tokenizer), settings, say)
    _EVALUATION_ENGINES[model] = (max_length, engine)
    return engine
