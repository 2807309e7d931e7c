"""The rollout engines, one entry each in `ENGINES`: the module that builds it, the engine it decodes for, and the
engine's own settings record. A new engine is one module under components/engine/generation/engines/ and one entry
here, nothing else: `GRPOConfig` inherits every record's fields as `grpo.*` keys (checked by each field's rule),
`choose.build_engine` tries the entries from the last to the first and hands each its record, the conformance suite
(tests/engine/generation/engines/test_engines.py) checks every entry's engine against the plain one, and dvc.yaml
depends on the engines package as a whole (tests/engine/generation/engines/test_engine_entries.py adds one to a copy of
the project).

An engine module has two functions:

- `build_for_run(base, tokens, run, settings, say) -> RolloutEngine | None`: the engine a run uses, or None when its
  settings switch it off or it does not apply to this model, device or run (saying why in one line where the user
  asked for it); `base` is the model, or the built engine of the entry named by `over`.
- `conformance(base, tokens, run) -> RolloutEngine`: the engine as the conformance suite checks it on any device
  (a CPU runs the CUDA-graph engine uncaptured); `base` as above, the named entry's conformance engine.

This module imports no torch, so loading a config stays fast.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from components.records import read_record, rules_of, setting, settings_keys


def _is_bool(value: object) -> bool:
    return isinstance(value, bool)


# ---- settings records: each engine's own `grpo.*` keys. Fields only (GRPOConfig inherits them), named as their keys.

@dataclass
class NoEngineSettings:
    """An engine without settings of its own."""


@dataclass
class PrefixSharing:
    """The prompt-once engine's switches."""

    prefix_sharing: bool = setting(True, "must be true or false", _is_bool)
    """Sample and score through the prompt-once engine (components/engine/generation/engines/prefix_shared.py): each
    prompt encoded once per group in sampling, reference and policy forwards. The families of fast/families.py only
    (Llama, Qwen2/3, Mistral, Gemma 2/3), checked against the Hugging Face forward at start; others fall back to the
    plain engine, as do several processes and per-group sampling (those need the wrapped, N-independent forward)."""
    onednn_matmul: bool = setting(True, "must be true or false", _is_bool)
    """With prefix sharing, float32 matrix products of 8M multiply-adds or more on the CPU run on oneDNN's kernels
    (components/engine/generation/fast/matmul.py), which pick their code by instruction set where MKL picks by CPU
    vendor: the gain is on AMD processors with AVX-512 (docs/performance.md has the figures). Rounding differs from
    PyTorch's own products; false keeps those."""


@dataclass
class CudaGraphs:
    """The CUDA-graph decoder's switch."""

    cuda_graphs: bool = setting(True, "must be true or false", _is_bool)
    """With prefix sharing on a CUDA device, decode with every step captured as a CUDA graph
    (components/engine/generation/engines/cuda_graphs.py: a preallocated KV cache, fixed row buckets, sampling inside
    the graph); a trial capture at start, and any capture that fails, turns it off with one line. False: the prompt-once
    engine's host-driven loop. No effect on the CPU."""


@dataclass(frozen=True)
class Engine:
    """One rollout engine: where it is built and what it reads."""

    name: str
    """Its name in logs and MLflow tags (the engine object's `name`)."""
    module: str
    """Its module under components/engine/generation/engines/ (with `build_for_run` and `conformance`)."""
    settings: type = NoEngineSettings
    """The record of this engine's own settings: a dataclass whose fields, made with `setting`, are `grpo.*` keys."""
    over: str | None = None
    """The entry whose built engine this one is built over (it decodes for it); None: built over the model."""
    in_the_band: bool = False
    """Its settings are in the default's fingerprint even at their defaults: the band (benchmarks/seed_spread.py) was
    measured with them. Any other engine's settings are left out while at their defaults, so adding an engine does
    not retire the band (away from its default a setting is in it like any other key)."""

    @property
    def module_path(self) -> str:
        return f"components.engine.generation.engines.{self.module}"


ENGINES: dict[str, Engine] = {engine.name: engine for engine in (
    Engine("hf", "hf"),  # the first entry always builds: every model, device and process count
    Engine("prefix_shared", "prefix_shared", PrefixSharing, in_the_band=True),
    Engine("cuda_graphs", "cuda_graphs", CudaGraphs, over="prefix_shared"),
)}
"""From the fallback to the most preferred: a run uses the last entry that builds."""

ENGINE_SETTINGS_RECORDS: tuple[type, ...] = tuple(dict.fromkeys(e.settings for e in ENGINES.values()))
"""Every entry's settings record, once each: `GRPOConfig` inherits their fields, so each field is a `grpo.*` key."""


def engine_settings(config: object | None = None) -> dict[str, object]:
    """Each entry's settings record by engine name, read from `config`'s attributes of the same names (`GRPOConfig`),
    or each record's defaults."""
    return {name: read_record(e.settings, config) if config is not None else e.settings()
            for name, e in ENGINES.items()}


def engine_setting_rules() -> Iterator[tuple[str, Callable[[Any], bool], str]]:
    """(key, valid, rule) for every engine setting that keeps a rule."""
    return rules_of(ENGINE_SETTINGS_RECORDS)


def neutral_engine_keys() -> list[str]:
    """The `grpo.*` keys of the engines whose settings the default's band was not measured with."""
    return [key for e in ENGINES.values() if not e.in_the_band for key in settings_keys(e.settings)]
