"""Model shapes the benchmarks build with random weights: each published config written out by hand (no hub access
here), plus a tiny one for rehearsals and tests.

    smollm2-135m   HuggingFaceTB/SmolLM2-135M-Instruct (Llama; 9 query heads over 3 key/value heads, tied)
    qwen2.5-0.5b   Qwen/Qwen2.5-0.5B (Qwen2: q|k|v biases, 14 over 2, tied)
    qwen2.5-1.5b   Qwen/Qwen2.5-1.5B (Qwen2: 12 over 2, tied)

Random weights decode at the same speed and hold the same memory as the real ones; they never choose EOS (one token
in 49,152 or 151,936 at random), which is why the speed rows draw every completion to its budget.
"""

from __future__ import annotations

from typing import Any

SHAPES: dict[str, dict[str, Any]] = {  # transformers config arguments; "kind" picks the model class
    "smollm2-135m": dict(kind="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536,
                         num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, hidden_act="silu",
                         rms_norm_eps=1e-5, rope_theta=100000.0, tie_word_embeddings=True,
                         max_position_embeddings=8192, bos_token_id=1, eos_token_id=2,
                         initializer_range=0.041666666666666664),
    "qwen2.5-0.5b": dict(kind="qwen2", vocab_size=151936, hidden_size=896, intermediate_size=4864,
                         num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2, hidden_act="silu",
                         rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=True,
                         max_position_embeddings=32768, sliding_window=32768, use_sliding_window=False,
                         max_window_layers=24, attention_dropout=0.0, bos_token_id=151643, eos_token_id=151643,
                         initializer_range=0.02),
    "qwen2.5-1.5b": dict(kind="qwen2", vocab_size=151936, hidden_size=1536, intermediate_size=8960,
                         num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2, hidden_act="silu",
                         rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=True,
                         max_position_embeddings=131072, sliding_window=131072, use_sliding_window=False,
                         max_window_layers=28, attention_dropout=0.0, bos_token_id=151643, eos_token_id=151643,
                         initializer_range=0.02),
    "tiny": dict(kind="llama", vocab_size=512, hidden_size=96, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=6, num_key_value_heads=2, tie_word_embeddings=True, max_position_embeddings=512),
    "tiny-qwen2": dict(kind="qwen2", vocab_size=768, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
                       max_position_embeddings=512, use_sliding_window=False),
}


def model_config(shape: str) -> Any:
    """The transformers config of `shape`."""
    from transformers import LlamaConfig, Qwen2Config

    spec = dict(SHAPES[shape])
    kind = spec.pop("kind")
    return (LlamaConfig if kind == "llama" else Qwen2Config)(**spec)


def random_model(shape: str, dtype: Any, device: Any, seed: int = 0) -> Any:
    """A randomly initialised model of `shape`, built on `device` (a 1.5B model's init on the host takes seconds)."""
    import torch
    from transformers import LlamaForCausalLM, Qwen2ForCausalLM

    config = model_config(shape)
    cls = LlamaForCausalLM if SHAPES[shape]["kind"] == "llama" else Qwen2ForCausalLM
    torch.manual_seed(seed)
    with torch.device(device):
        return cls(config).to(dtype=dtype)


def parameter_count(shape: str) -> int:
    """Parameters of `shape` (tied embeddings counted once), from its config alone."""
    s = SHAPES[shape]
    hidden, inter, layers = s["hidden_size"], s["intermediate_size"], s["num_hidden_layers"]
    d = hidden // s["num_attention_heads"]
    kv = s["num_key_value_heads"] * d
    bias = (hidden + 2 * kv) if s["kind"] == "qwen2" else 0
    per_layer = hidden * (hidden + 2 * kv) + bias + hidden * hidden + 3 * hidden * inter + 2 * hidden
    head = 0 if s.get("tie_word_embeddings") else s["vocab_size"] * hidden
    return s["vocab_size"] * hidden + layers * per_layer + hidden + head
