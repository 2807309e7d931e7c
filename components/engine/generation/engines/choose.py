"""Which rollout engine runs: decided here, once, when the policy (or an evaluation's generation) is built, from the
entries of components/rollout_engines.py, their settings and the device. No engine is named here: each entry's module
builds its engine or declines."""

from __future__ import annotations

import importlib
import weakref
from collections.abc import Callable, Mapping
from typing import Any

import torch

from components.engine.generation.engines.base import EngineRun, RolloutEngine, SpecialTokens
from components.rollout_engines import ENGINES, Engine, engine_settings

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


def engine_module(entry: Engine) -> Any:
    """The module that builds `entry` (its `build_for_run` and `conformance`)."""
    return importlib.import_module(entry.module_path)


def build_engine(model: Any, tokens: SpecialTokens, run: EngineRun, settings: Mapping[str, Any] | None = None,
                 say: Callable[..., None] = print) -> RolloutEngine:
    """The last entry of `ENGINES` that builds over `model` (each entry built over the model or over the engine of
    the entry it names in `over`, each at most once), given each entry's settings record by name (`engine_settings`;
    None: the defaults). The first entry, the plain engine, always builds. Every line an engine says about why it
    declined is said once per model."""
    say = _once(say, model)
    settings = engine_settings() | dict(settings or {})
    built: dict[str, RolloutEngine | None] = {}

    def built_engine(entry: Engine) -> RolloutEngine | None:
        if entry.name not in built:
            base = model if entry.over is None else built_engine(ENGINES[entry.over])
            built[entry.name] = None if base is None else engine_module(entry).build_for_run(
                base, tokens, run, settings[entry.name], say)
        return built[entry.name]

    for entry in reversed(ENGINES.values()):
        if (engine := built_engine(entry)) is not None:
            return engine
    raise RuntimeError(f"no engine of {list(ENGINES)} built (the first must build for any model)")


def conformance_engine(model: Any, tokens: SpecialTokens, run: EngineRun, name: str) -> RolloutEngine:
    """Entry `name`'s engine as the conformance suite (tests/engine/generation/engines/test_engines.py) checks it on
    any device: its module's `conformance`, over the model or over the conformance engine of the entry it names in
    `over`."""
    entry = ENGINES[name]
    base = model if entry.over is None else conformance_engine(model, tokens, run, entry.over)
    return engine_module(entry).conformance(base, tokens, run)


def plain_engine(model: Any, tokens: SpecialTokens) -> RolloutEngine:
    """The first entry's engine, the plain one, over `model` (tests and tools that build a policy by hand)."""
    first = next(iter(ENGINES.values()))
    return engine_module(first).build_for_run(model, tokens, EngineRun(), first.settings(), print)


def through_trainer(engine: RolloutEngine, trainer: Any) -> RolloutEngine:
    """`engine` with gradient forwards through `trainer` (DDP's wrapper): only the plain engine, built for wrapped
    runs, forwards through a wrapper."""
    if not hasattr(engine, "with_trainer"):
        raise TypeError(f"a wrapped model trains through the plain engine, not {engine.name!r}")
    return engine.with_trainer(trainer)


_EVALUATION_ENGINES: weakref.WeakKeyDictionary[Any, tuple[int, RolloutEngine]] = weakref.WeakKeyDictionary()


def evaluation_engine(model: Any, tokenizer: Any, completion_length: int, max_length: int,
                      settings: Mapping[str, Any] | None = None, say: Callable[..., None] = print,
                      stop_together: Callable[[bool], bool] | None = None) -> RolloutEngine:
    """The engine held-out evaluation, pass@k and SFT's stop check run on: `build_engine` over rows of `max_length`
    tokens with the run's engine settings (`engine_settings(cfg.grpo)`; a sharded model, which decodes in lockstep
    through `stop_together`, gets the plain engine).

    An engine's self-check (forwards and backwards of rows that long) runs once per model object and row length:
    SFT's stop check and the held-out probe during GRPO evaluate the same model, whose weights change but whose
    structure does not. It compares gradients, so it runs with them on, whatever the caller's mode; it writes no
    `.grad`."""
    cached = _EVALUATION_ENGINES.get(model)
    if cached is not None and cached[0] >= max_length:
        return cached[1]
    run = EngineRun(vocab_size=len(tokenizer), max_length=max_length, completion_length=completion_length,
                    wrapped=stop_together is not None, stop_together=stop_together)
    with torch.enable_grad():
        engine = build_engine(model, SpecialTokens.of(tokenizer), run, settings, say)
    _EVALUATION_ENGINES[model] = (max_length, engine)
    return engine
