"""Completions of prompt texts with the plain Hugging Face engine: the reference tests compare the others with."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from components.engine.models.rollouts import Rollouts, encode_prompts
from components.engine.rollout.base import SamplingParams, SpecialTokens
from components.engine.rollout.hf import HFEngine


def sample_texts(model: Any, tokenizer: Any, prompts: Sequence[str], params: SamplingParams,
                 generator: torch.Generator | None = None) -> Rollouts:
    return HFEngine(model, SpecialTokens.of(tokenizer)).sample(encode_prompts(tokenizer, prompts), params, generator)
