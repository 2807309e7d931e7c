"""The tiny default's checkpoint, written with torch alone.

`model` is the second stage of every default run. Building the tiny Llama through Hugging Face
needs its modelling code (`transformers.modeling_utils` and everything it pulls in, about 1.6
CPU-seconds to import), and at that point of a run the stage server's level that has it is still
importing it: `model` waited 2-4 s for it after `prepare`. This module writes the files that
`LlamaForCausalLM(config).save_pretrained(...)` writes, byte for byte (tests/test_tiny_checkpoint.py
builds both and compares them), from the level that has only torch and the tokenizer.

What it reproduces, for transformers 5 with tied embeddings (the test fails if either changes):
- the random draws: constructing the model draws the embedding (`normal`) and every linear layer
  (`kaiming_uniform`) in module order; Hugging Face's initialisation then redraws each of them
  from `normal(0, initializer_range)` in the same order and zeroes the padding row. Norms are ones.
  No `lm_head` is drawn or saved: it is the embedding.
- `config.json` and `generation_config.json` as `to_json_string` writes them (sorted keys, indent 2).
- `model.safetensors` with the metadata `{"format": "pt"}`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

from components.config import TinyModelConfig

INITIALIZER_RANGE = 0.02
LAYER_PROJECTIONS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                     "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


def tiny_llama_config(tiny: TinyModelConfig, vocab_size: int, pad: int, bos: int, eos: int) -> dict[str, Any]:
    """`LlamaConfig(...).to_dict()` for the tiny default, as Hugging Face saves it (its defaults spelled out)."""
    import transformers

    return {
        "architectures": ["LlamaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
        "bos_token_id": bos, "dtype": "float32", "eos_token_id": eos,
        "head_dim": tiny.hidden_size // tiny.num_heads, "hidden_act": "silu", "hidden_size": tiny.hidden_size,
        "initializer_range": INITIALIZER_RANGE, "intermediate_size": tiny.intermediate_size,
        "max_position_embeddings": tiny.max_position_embeddings, "mlp_bias": False, "model_type": "llama",
        "num_attention_heads": tiny.num_heads, "num_hidden_layers": tiny.num_layers,
        "num_key_value_heads": tiny.num_heads, "pad_token_id": pad, "pretraining_tp": 1, "rms_norm_eps": 1e-06,
        "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"}, "tie_word_embeddings": True,
        "transformers_version": transformers.__version__, "use_cache": True, "vocab_size": vocab_size,
    }


def tiny_llama_weights(tiny: TinyModelConfig, vocab_size: int, pad: int, seed: int) -> dict[str, torch.Tensor]:
    """The state dict `torch.manual_seed(seed); LlamaForCausalLM(config)` produces (without the tied lm_head)."""
    hidden, inner = tiny.hidden_size, tiny.intermediate_size
    shapes = {"self_attn.q_proj": (hidden, hidden), "self_attn.k_proj": (hidden, hidden),
              "self_attn.v_proj": (hidden, hidden), "self_attn.o_proj": (hidden, hidden),
              "mlp.gate_proj": (hidden, inner), "mlp.up_proj": (hidden, inner), "mlp.down_proj": (inner, hidden)}
    torch.manual_seed(seed)
    # Construction: the draws torch's own layer initialisers make, in module order.
    embedding = nn.Embedding(vocab_size, hidden, padding_idx=pad).weight
    layers = [{name: nn.Linear(*shapes[name], bias=False).weight for name in LAYER_PROJECTIONS}
              for _ in range(tiny.num_layers)]
    weights: dict[str, torch.Tensor] = {"model.embed_tokens.weight": embedding}
    with torch.no_grad():  # Hugging Face's `_init_weights`, in the same order
        embedding.normal_(0.0, INITIALIZER_RANGE)
        embedding[pad].zero_()
        for index, layer in enumerate(layers):
            for name in LAYER_PROJECTIONS:
                weights[f"model.layers.{index}.{name}.weight"] = layer[name].normal_(0.0, INITIALIZER_RANGE)
            weights[f"model.layers.{index}.input_layernorm.weight"] = torch.ones(hidden)
            weights[f"model.layers.{index}.post_attention_layernorm.weight"] = torch.ones(hidden)
    weights["model.norm.weight"] = torch.ones(hidden)
    return {name: tensor.detach().contiguous() for name, tensor in weights.items()}


def write_tiny_checkpoint(tiny: TinyModelConfig, tokenizer, seed: int, out_dir: Path) -> int:
    """Write the tiny Llama and `tokenizer` to `out_dir` as `save_pretrained` would; returns the parameter count."""
    from safetensors.torch import save_file

    ids = {"pad": tokenizer.pad_token_id, "bos": tokenizer.bos_token_id, "eos": tokenizer.eos_token_id}
    config = tiny_llama_config(tiny, len(tokenizer), **ids)
    generation = {"_from_model_config": True, "bos_token_id": ids["bos"], "eos_token_id": ids["eos"],
                  "output_attentions": False, "output_hidden_states": False, "pad_token_id": ids["pad"],
                  "transformers_version": config["transformers_version"], "use_cache": True}
    weights = tiny_llama_weights(tiny, len(tokenizer), ids["pad"], seed)
    out_dir.mkdir(parents=True, exist_ok=True)
    for name, content in (("config.json", config), ("generation_config.json", generation)):
        (out_dir / name).write_text(json.dumps(content, indent=2, sort_keys=True) + "\n")
    save_file(weights, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    tokenizer.save_pretrained(str(out_dir))
    return sum(tensor.numel() for tensor in weights.values())
