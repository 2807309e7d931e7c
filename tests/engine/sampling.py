"""Completions of prompt texts with the plain Hugging Face engine: the reference tests compare the others with."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from components.engine.generation.engines.base import SamplingParams, SpecialTokens
from components.engine.generation.engines.hf import HFEngine
from components.engine.generation.rollouts import Rollouts, encode_prompts


def sample_texts(model: Any, tokenizer: Any, prompts: Sequence[str], params: SamplingParams,
                 generator: torch.Generator | None = None) -> Rollouts:
    return HFEngine(model, SpecialTokens.of(tokenizer)).sample(encode_prompts(tokenizer, prompts), params, generator)
