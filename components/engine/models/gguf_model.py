"""GGUF in, safetensors out: a quantised llama.cpp model file becomes a normal float HF checkpoint.

transformers reads GGUF files (with the `gguf` package) and dequantises the weights, but the model it
returns refuses `save_pretrained` ("quantized with gguf and is not serializable"). Rebuilding the model
from its config without `quantization_config` and loading the dequantised state dict gives an ordinary
model that saves to safetensors, so every later stage, the registry and serving see a plain HF folder.
"""

from __future__ import annotations

import functools
import hashlib
import os
from collections.abc import Iterator
from contextlib import contextmanager
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
    with gguf_parsed_once():
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


@contextmanager
def gguf_parsed_once() -> Iterator[None]:
    """Within the block, `gguf` parses a file and builds a tensor-name table once each.

    transformers opens the file three times for one model (tokenizer, config, weights), each time parsing all of its
    metadata again (a tokenizer's vocabulary and merges: tens of thousands of strings), and while matching tensor
    names it builds gguf's name table for the architecture once per module of the model (hundreds of identical
    tables). Both are pure functions of their arguments (the reader maps the file read-only), so they are memoised
    here; transformers looks both up in the `gguf` module when it calls them, and the originals are back after the
    block. Not for use from several threads at once.
    """
    import gguf

    reader_class, name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    readers: dict[tuple[str, str], object] = {}

    def reader(path: os.PathLike[str] | str, mode: str = "r"):
        key = (os.path.realpath(path), mode)
        if key not in readers:
            readers[key] = reader_class(path, mode)
        return readers[key]

    gguf.GGUFReader, gguf.get_tensor_name_map = reader, functools.cache(name_map)
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = reader_class, name_map
