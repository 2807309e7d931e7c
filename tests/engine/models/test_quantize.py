"""A 4-bit frozen base under LoRA (`grpo.lora.quantize_base: nf4`, torchao's NF4): the decoder layers' projections
stored in 4 bits, values within NF4's rounding, gradients reaching the adapters only. tests/engine/generation/engines/
test_engines.py samples and scores such a model through every engine."""

from __future__ import annotations

import sys

import pytest
import torch

from components.config import ConfigError, LoRAConfig
from components.engine.grpo.policy import attach_lora
from components.engine.models.quantize import quantize_base

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=24, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64))


def test_every_projection_is_stored_in_four_bits_within_nf4_rounding():
    model = _llama()
    dense = {n: p.detach().clone() for n, p in model.named_parameters() if n.endswith("proj.weight")}
    assert quantize_base(model, "nf4") == (14, 0)
    stored = 0
    for name, p in model.named_parameters():
        if name in dense:
            assert type(p).__name__ == "NF4Tensor" and not p.requires_grad
            restored = p.to(dense[name].dtype)
            error = (restored - dense[name]).abs().max() / dense[name].abs().max()
            assert 0 < error < 0.15, f"{name}: {error}"  # 4 bits: 16 levels over each block's range
            stored += sum(t.numel() * t.element_size() for t in (p.quantized_data, p.quantized_scalers,
                                                                  p.quantization_factor))
    assert stored < 0.35 * sum(t.numel() * t.element_size() for t in dense.values())
    assert type(model.lm_head.weight) is torch.nn.Parameter and type(model.model.embed_tokens.weight) is \
        torch.nn.Parameter


def test_the_adapters_train_over_the_frozen_four_bit_base():
    model = attach_lora(_llama(), LoRAConfig(enabled=True, rank=4, quantize_base="nf4",
                                             target_modules=list(PROJECTIONS)))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.1)
    ids = torch.randint(0, 24, (3, 7), generator=torch.Generator().manual_seed(0))
    model(input_ids=ids).logits.square().mean().backward()
    trained = {n for n, p in model.named_parameters() if p.grad is not None and p.grad.abs().sum() > 0}
    assert trained and all("lora_" in n for n in trained)
    assert len(trained) == 2 * 2 * len(PROJECTIONS)  # A and B of every projection of both layers


def test_without_torchao_the_setting_is_refused_before_training(monkeypatch):
    monkeypatch.setitem(sys.modules, "torchao.quantization", None)
    with pytest.raises(ConfigError, match="grpo.lora.quantize_base: nf4 needs torchao"):
        quantize_base(_llama(), "nf4")
