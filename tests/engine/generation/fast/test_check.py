"""The fast path's self-check in half precision: structure checked exactly in float32, the dtype's rounding against
Hugging Face's own (components/engine/generation/fast/check.py). bfloat16 runs on the CPU too, so these need no GPU."""

from __future__ import annotations

import copy

import pytest
import torch

from components.engine.generation.fast import check
from components.engine.generation.fast.build import checked_prefix_shared_lm
from components.engine.generation.fast.fastlm import PrefixSharedLM
from components.engine.generation.fast.pieces import ModelPieces
from components.engine.generation.logprobs import completion_logprobs
from components.engine.generation.rollouts import Rollouts
from tests.engine.generation.fast.test_fastlm import ALL_PROJECTIONS, VOCAB, _llama, _rollout, _sample


def _loud_bfloat16_llama():
    """A tiny Llama in bfloat16 whose logits are large (head x 150), so bfloat16's rounding alone moves log-probs by
    far more than a fixed 0.1: as SmolLM2-135M's do (0.3-0.5 nats), where a 0.1 tolerance refused every such model."""
    model = _llama(num_key_value_heads=2)
    with torch.no_grad():
        model.lm_head.weight.mul_(150.0)
    return model.to(torch.bfloat16)


def _largest_error_against_hugging_face(fast: PrefixSharedLM, rollout: Rollouts) -> float:
    with torch.no_grad():
        ours = fast.completion_logprobs(rollout)[0]
        theirs = completion_logprobs(fast.model, rollout)[0]
    mask = rollout.completion_mask.bool()
    return float((ours - theirs)[mask].abs().max())


def test_a_bfloat16_model_keeps_the_fast_path_where_its_rounding_exceeds_any_fixed_tolerance():
    model = _loud_bfloat16_llama()
    fast = checked_prefix_shared_lm(model, max_length=40, completion_length=8)
    assert fast is not None
    assert _largest_error_against_hugging_face(fast, _rollout()) > 0.1  # what the old fixed tolerance refused


def test_the_check_leaves_every_weight_bit_for_bit_and_in_its_own_dtype():
    from components.config import LoRAConfig
    from components.engine.grpo.policy import attach_lora

    model = attach_lora(_loud_bfloat16_llama(), LoRAConfig(enabled=True, rank=4, target_modules=ALL_PROJECTIONS))
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    assert any(p.dtype == torch.float32 for p in before.values())  # peft keeps the adapters in float32
    assert checked_prefix_shared_lm(model, max_length=40, completion_length=8) is not None
    for name, p in model.named_parameters():
        assert p.dtype == before[name].dtype and torch.equal(p, before[name]), name


def test_a_fault_only_the_half_precision_path_has_is_caught(monkeypatch):
    """Half precision attends through PyTorch's fused attention, a branch float32 never takes: only the check in the
    model's own dtype can see it ignore the mask."""
    model = _loud_bfloat16_llama()
    original = ModelPieces.attend

    def unmasked(self, q, keys, values, bias):
        return original(self, q, keys, values, torch.zeros_like(bias) if q.dtype == torch.bfloat16 else bias)

    monkeypatch.setattr(ModelPieces, "attend", unmasked)
    fast = PrefixSharedLM(model)
    with check.float32_weights(model):
        assert check.matches_reference_forward(fast, VOCAB, 20, 8)  # float32 never takes the faulty branch
    assert not check.matches_reference_forward(fast, VOCAB, 20, 8)


def test_a_structural_fault_is_caught_in_float32_before_rounding_can_hide_it(monkeypatch):
    model = _loud_bfloat16_llama()
    pieces = ModelPieces.__init__

    def scale_off(self, *args):  # 5% off: inside bfloat16's rounding on these logits, far outside float32's
        pieces(self, *args)
        self.scaling *= 1.05

    monkeypatch.setattr(ModelPieces, "__init__", scale_off)
    assert not check.matches_reference_forward(PrefixSharedLM(model), VOCAB, 20, 8)


def test_the_gradients_are_checked_in_half_precision_too(monkeypatch):
    model = _loud_bfloat16_llama()
    fast = PrefixSharedLM(model)
    assert check.trains_like_reference_forward(fast, VOCAB)
    original = fast.completion_logprobs

    def doubled_in_bfloat16(rollout, *args, **kwargs):  # a backward that is wrong in the model's dtype only
        logp, entropy = original(rollout, *args, **kwargs)
        if model.model.embed_tokens.weight.dtype == torch.bfloat16:
            logp = logp + (logp - logp.detach())
        return logp, entropy

    monkeypatch.setattr(fast, "completion_logprobs", doubled_in_bfloat16)
    assert not check.trains_like_reference_forward(fast, VOCAB)


def test_lora_decoding_of_a_bfloat16_model_merges_the_float32_adapters_in_bfloat16():
    from components.config import LoRAConfig
    from components.engine.generation.fast.layers import plain_linear
    from components.engine.grpo.policy import attach_lora

    model = attach_lora(_llama(num_key_value_heads=2).to(torch.bfloat16),
                        LoRAConfig(enabled=True, rank=4, target_modules=ALL_PROJECTIONS))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)
    wrapped = model.get_base_model().model.layers[0].self_attn.q_proj
    assert wrapped.lora_A["default"].weight.dtype == torch.float32
    assert plain_linear(wrapped, merge_lora=True)[0].dtype == torch.bfloat16
    fast = checked_prefix_shared_lm(copy.deepcopy(model), max_length=20, completion_length=6)
    assert fast is not None
    prompts = torch.tensor([[0, 0, 5, 6, 7], [8, 9, 10, 11, 12]])
    rollout = _sample(fast.model, prompts, (prompts != 0).long(), 4, 6, torch.Generator().manual_seed(3), fast)
    assert rollout.completion_ids.shape == (8, 6)


def test_no_room_for_the_float32_copy_is_said_not_run_out_of(monkeypatch):
    from types import SimpleNamespace

    model = _loud_bfloat16_llama()
    monkeypatch.setattr(check.psutil, "virtual_memory", lambda: SimpleNamespace(available=1024))
    with pytest.raises(MemoryError, match="float32"), check.float32_weights(model):
        pass
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())


def _four_layers_lora_on_the_third():
    """A 4-layer Llama whose third layer alone carries LoRA on q_proj (non-zero B): a layer of its own kind."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    base = LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                                        num_attention_heads=4, max_position_embeddings=64)).eval()
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"], layers_to_transform=[2]))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)
    return model


def test_the_check_runs_the_first_the_last_and_each_other_kind_of_layer_only(monkeypatch):
    """Layer 1 is of layer 0's kind, so the check never runs it; layer 2 (LoRA) is another kind, so a fault only
    LoRA-wrapped projections have is still caught; the decoder gets its whole list back."""
    from components.engine.generation.fast import pieces

    model = _four_layers_lora_on_the_third()
    layers = model.get_base_model().model.layers
    with check.representative_layers(PrefixSharedLM(model)) as held:
        assert held == 3 and list(model.get_base_model().model.layers) == [layers[0], layers[2], layers[3]]
    assert model.get_base_model().model.layers is layers
    ran = {i: 0 for i in range(4)}
    for i, layer in enumerate(layers):
        layer.register_forward_pre_hook(lambda *_, i=i: ran.__setitem__(i, ran[i] + 1))
    assert checked_prefix_shared_lm(model, max_length=20, completion_length=4) is not None
    assert ran[1] == 0 and min(ran[0], ran[2], ran[3]) > 0, ran

    plain = pieces.plain_linear

    def adapters_ignored(module, merge_lora=False):  # merged LoRA read as its base weight alone
        base = getattr(module, "base_layer", None)
        return (base.weight, base.bias) if merge_lora and base is not None else plain(module, merge_lora)

    monkeypatch.setattr(pieces, "plain_linear", adapters_ignored)
    assert checked_prefix_shared_lm(model, max_length=20, completion_length=4) is None
