"""The starting policy: a model to load, or the shape of the tiny default built offline, with its checks."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from components.config.rules import _require


@dataclass
class TinyModelConfig:
    """Shape of the tiny Llama built offline when `model.name_or_path` is unset."""

    hidden_size: int = 128
    """Width of the residual stream."""
    num_layers: int = 4
    """Transformer blocks."""
    num_heads: int = 4
    """Attention heads (hidden_size must divide by it)."""
    intermediate_size: int = 256
    """MLP width."""
    max_position_embeddings: int = 32
    """Context length in tokens (characters, with the char tokenizer)."""


@dataclass
class ModelConfig:
    """The starting policy."""

    name_or_path: str | None = None
    """A local Hugging Face model directory, a `.gguf` file (converted once to safetensors by the `model`
    stage), or `package:MODULE/FILE.gguf` for a GGUF shipped inside an installed Python package; unset
    builds the tiny default from `tiny`."""
    gguf_file: str | None = None
    """The GGUF file's name when name_or_path is the folder holding it."""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """Weights dtype; `auto`: bfloat16 on a GPU that supports it, float32 otherwise."""
    trust_remote_code: bool = False
    """Allow model code shipped inside the model directory (off unless you trust it)."""
    allow_download: bool = False
    """Let a hub id in name_or_path be downloaded by transformers (also needs HF_HUB_OFFLINE unset or 0)."""
    tiny: TinyModelConfig = field(default_factory=TinyModelConfig)
    """Architecture of the tiny default."""


def check_model(m: ModelConfig) -> None:
    """model: the tiny default's shape (its context length against the completions is a pipeline rule)."""
    tiny = m.tiny
    _require(tiny.hidden_size % tiny.num_heads == 0, "model.tiny.num_heads", "must divide model.tiny.hidden_size")
    for name in ("hidden_size", "num_layers", "num_heads", "intermediate_size", "max_position_embeddings"):
        _require(getattr(tiny, name) >= 1, f"model.tiny.{name}", "must be >= 1")
