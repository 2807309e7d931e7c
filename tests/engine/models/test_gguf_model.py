"""GGUF conversion: inside `gguf_parsed_once` a file is parsed once and a tensor-name table built once, however often
transformers asks; outside it `gguf` is as it was. (The conversion of the real SmolLM2 GGUF and what the converted
model answers: tests/stages/test_real_model.py.)"""

from __future__ import annotations

import numpy as np
import pytest

from components.engine.models.gguf_model import gguf_parsed_once

gguf = pytest.importorskip("gguf")


def tiny_gguf(path) -> None:
    """A llama GGUF of one float32 tensor and a three-token vocabulary."""
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(2)
    writer.add_token_list(["<s>", "a", "b"])
    writer.add_tensor("token_embd.weight", np.arange(6, dtype=np.float32).reshape(3, 2))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_a_gguf_is_parsed_once_and_its_name_table_built_once_inside_the_block(tmp_path):
    path = tmp_path / "tiny.gguf"
    tiny_gguf(path)
    original_reader, original_map = gguf.GGUFReader, gguf.get_tensor_name_map
    with gguf_parsed_once():
        first = gguf.GGUFReader(path)
        assert gguf.GGUFReader(str(path)) is first  # the tokenizer's, the config's and the weights' read: one parse
        assert [str(bytes(first.fields["tokenizer.ggml.tokens"].parts[i]), "utf-8")
                for i in first.fields["tokenizer.ggml.tokens"].data] == ["<s>", "a", "b"]
        assert first.tensors[0].data.tolist() == [[0.0, 1.0], [2.0, 3.0], [4.0, 5.0]]
        arch = gguf.MODEL_ARCH.LLAMA
        assert gguf.get_tensor_name_map(arch, 2) is gguf.get_tensor_name_map(arch, 2)  # one table, not one a module
    assert gguf.GGUFReader is original_reader and gguf.get_tensor_name_map is original_map
    assert gguf.GGUFReader(path) is not first
    assert gguf.get_tensor_name_map(arch, 2) is not gguf.get_tensor_name_map(arch, 2)
