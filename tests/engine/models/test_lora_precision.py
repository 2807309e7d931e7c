"""LoRA in a half-precision model: adapters applied in its dtype (no float32 activation saved for the backward), kept
float32 for the optimizer, with gradients no further from the float32 model's than peft's own float32 path's
(the fast path's half-precision rule); a float32 model unchanged."""

from __future__ import annotations

import copy

import pytest
import torch

from components.config import LoRAConfig
from components.engine.generation.fast.check import _rounds_like_hugging_face
from components.engine.grpo.policy import attach_lora
from components.engine.models.lora_precision import InputDtypeLinear, adapters_in_model_dtype

LORA = LoRAConfig(enabled=True, rank=4, alpha=8.0, target_modules=["q_proj", "v_proj", "up_proj", "down_proj"])


def _model():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=48, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64))


def _adapted(base, dtype: torch.dtype, ours: bool):
    """`base` with LoRA in `dtype`: through attach_lora (ours) or peft alone; the same adapter weights in each (B
    non-zero, so A has a gradient)."""
    model = copy.deepcopy(base).to(dtype)
    if ours:
        model = attach_lora(model, LORA)
    else:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=LORA.rank, lora_alpha=LORA.alpha,
                                                 target_modules=list(LORA.target_modules), task_type="CAUSAL_LM"))
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=generator) * 0.1)
    return model


def _loss(model) -> torch.Tensor:
    ids = torch.arange(24).reshape(2, 12) % 48
    logp = model(input_ids=ids).logits.float().log_softmax(-1)
    return -logp[:, :-1].gather(-1, ids[:, 1:, None]).mean()


def _lora_grads(model) -> list[torch.Tensor]:
    return [p.grad.float().clone() for name, p in sorted(model.named_parameters()) if "lora_" in name]


def test_an_adapted_projection_saves_no_float32_tensor_for_backward():
    model = _adapted(_model(), torch.bfloat16, ours=True)
    saved: list[torch.dtype] = []
    inside = [False]
    layers = [m for m in model.modules() if hasattr(m, "lora_A") and hasattr(m, "base_layer")]
    assert layers
    for layer in layers:
        layer.register_forward_pre_hook(lambda *_: inside.__setitem__(0, True))
        layer.register_forward_hook(lambda *_: inside.__setitem__(0, False))

    def pack(t: torch.Tensor) -> torch.Tensor:
        if inside[0]:
            saved.append(t.dtype)
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        _loss(model)
    assert saved and torch.float32 not in saved, saved
    assert all(p.dtype == torch.float32 for name, p in model.named_parameters() if "lora_" in name)
    assert all(type(layer.lora_A["default"]) is InputDtypeLinear for layer in layers)


def test_gradients_round_like_peft_own_half_precision_path():
    base = _model()
    exact, theirs, ours = (_adapted(base, dtype, mine) for dtype, mine in
                           ((torch.float32, True), (torch.bfloat16, False), (torch.bfloat16, True)))
    for model in (exact, theirs, ours):
        _loss(model).backward()
    grads = [_lora_grads(m) for m in (ours, theirs, exact)]
    assert all(float(g.abs().sum()) > 0 for g in grads[2])
    assert _rounds_like_hugging_face(*grads)
    perturbed = [g * 1.05 for g in grads[0]]  # the rule is tight enough to see a 5% error
    assert not _rounds_like_hugging_face(perturbed, grads[1], grads[2])


@pytest.mark.parametrize("dtype,changed", [(torch.float32, 0), (torch.bfloat16, 8)])
def test_only_a_half_precision_model_changes(dtype, changed):
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(_model().to(dtype), LoraConfig(r=4, target_modules=list(LORA.target_modules),
                                                          task_type="CAUSAL_LM"))
    assert adapters_in_model_dtype(model) == changed
