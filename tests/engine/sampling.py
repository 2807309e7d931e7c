"""The char-level tiny model saved once per test module, and completions of prompt texts with the plain Hugging Face
engine: the reference the tests compare the others with."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from components.config import TinyModelConfig
from components.engine.generation.engines.base import SamplingParams, SpecialTokens
from components.engine.generation.engines.hf import HFEngine
from components.engine.generation.rollouts import Rollouts, encode_prompts
from components.engine.models.modeling import build_char_tokenizer, build_tiny_model, save_model

TEXTS = ["12+34=", "46", "99+1=", "100", "7+8=", "15"]


def saved_tiny_model(folder: Path) -> Path:
    """The tiny model of the default config over a char tokenizer of `TEXTS`, seed 0, saved in `folder`."""
    tok = build_char_tokenizer(TEXTS)
    save_model(build_tiny_model(TinyModelConfig(), tok, seed=0), tok, folder)
    return folder


def sample_texts(model: Any, tokenizer: Any, prompts: Sequence[str], params: SamplingParams,
                 generator: torch.Generator | None = None) -> Rollouts:
    return HFEngine(model, SpecialTokens.of(tokenizer)).sample(encode_prompts(tokenizer, prompts), params, generator)
