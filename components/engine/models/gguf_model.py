"""GGUF in, safetensors out: a quantised llama.cpp model file becomes a normal float HF checkpoint.

transformers reads GGUF files (with the `gguf` package) and dequantises the weights, but the model it
returns refuses `save_pretrained` ("quantized with gguf and is not serializable"). Rebuilding the model
from its config without `quantization_config` and loading the dequantised state dict gives an ordinary
model that saves to safetensors, so every later stage, the registry and serving see a plain HF folder.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from components.data.model_source import require_gguf_reader


def file_sha256(path: Path, chunk: int = 1 << 22) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while block := handle.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def convert_gguf(path: Path, out_dir: Path) -> int:
    """Dequantise `path` to a float32 safetensors checkpoint plus its tokenizer in `out_dir`; returns
    the parameter count. The tokenizer keeps the GGUF's chat template and special tokens."""
    require_gguf_reader()
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from components.engine.models.modeling import save_tokenizer

    folder, name = str(path.parent), path.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict())
    model.tie_weights()
    del loaded
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out_dir), safe_serialization=True)
    save_tokenizer(tokenizer, out_dir)
    return sum(p.numel() for p in model.parameters())
