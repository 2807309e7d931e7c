"""The prompt-once forward (components/engine/generation/fast/) against the Hugging Face forward it replaces.

Each architecture it accepts is built small with random weights; log-probs, gradients and decoded
tokens must match the plain forward on left-padded batches with repeated prompts.
"""

import copy
import dataclasses

import pytest
import torch

from components.engine.generation.engines.base import SamplingParams, SpecialTokens
from components.engine.generation.engines.hf import HFEngine
from components.engine.generation.engines.prefix_shared import PrefixSharedEngine
from components.engine.generation.fast import check
from components.engine.generation.fast.build import checked_prefix_shared_lm
from components.engine.generation.fast.fastlm import PrefixSharedLM
from components.engine.generation.fast.pieces import ModelPieces
from components.engine.generation.fast.rows import distinct_rows, group_rows_extra_work
from components.engine.generation.logprobs import completion_logprobs
from components.engine.generation.rollouts import Turn

VOCAB = 24


def _llama(**extra):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                        num_attention_heads=4, max_position_embeddings=64, **extra)).eval()


def _qwen2():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    return Qwen2ForCausalLM(Qwen2Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2,
                                        max_position_embeddings=64)).eval()


def _qwen3():
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    return Qwen3ForCausalLM(Qwen3Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                        max_position_embeddings=64)).eval()


def _with_random_norms(model):
    """Gemma's norms scale by (1 + w) from w = 0: random w, so that a plain w (or none) would show."""
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    return model.eval()


def _gemma2():
    """Gemma 2: scaled embeddings, (1 + w) norms around each sublayer, GeGLU, a query scale of its own, tanh-capped
    scores and logits (caps small enough to matter here), alternating sliding-window and global layers."""
    from transformers import Gemma2Config, Gemma2ForCausalLM

    torch.manual_seed(0)
    return _with_random_norms(Gemma2ForCausalLM(Gemma2Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=24, attn_logit_softcapping=2.0,
        final_logit_softcapping=3.0, sliding_window=64, max_position_embeddings=64, attn_implementation="eager")))


def _gemma3():
    """Gemma 3 (text): Gemma 2's layout with per-head query/key norms, no soft-capping, and local layers rotating with
    another base than global ones."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(0)
    return _with_random_norms(Gemma3ForCausalLM(Gemma3TextConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=24, sliding_window=64,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"], max_position_embeddings=64,
        attn_implementation="eager")))


ARCHITECTURES = {
    "llama": lambda: _llama(),
    "llama-gqa-tied": lambda: _llama(num_key_value_heads=2, tie_word_embeddings=True),
    "qwen2-bias-gqa": _qwen2,
    "qwen3-qk-norm": _qwen3,
    "gemma2": _gemma2,
    "gemma3": _gemma3,
}


def _rollout(rows: tuple[int, ...] = (0, 0, 1, 1, 1, 2)) -> Turn:
    """Three distinct left-padded prompts repeated as `rows` (groups), right-padded completions.

    The default groups have unequal sizes (the gathered cache path); (0, 0, 1, 1, 2, 2) gives equal
    groups, where each prompt's cache is broadcast to its rows instead.
    """
    gen = torch.Generator().manual_seed(1)
    prompts = torch.randint(4, VOCAB, (3, 6), generator=gen)
    prompt_mask = torch.ones_like(prompts)
    prompt_mask[1, :3] = 0
    prompt_mask[2, :1] = 0
    prompts = prompts * prompt_mask  # pad id 0 in the padded slots
    rows = torch.tensor(rows)
    completions = torch.randint(4, VOCAB, (6, 5), generator=gen)
    completion_mask = torch.ones_like(completions)
    completion_mask[1, 3:] = 0
    completions = completions * completion_mask
    return Turn(prompts[rows], prompt_mask[rows], completions, completion_mask, torch.zeros(6, dtype=torch.bool))


def _logprobs_and_grads(model, rollout: Turn, logprobs) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Completion log-probs from `logprobs(rollout, 0.7)` and the gradients of a fixed weighted sum of them."""
    weights = torch.linspace(-1, 1, len(rollout))[:, None] * rollout.completion_mask
    model.zero_grad()
    logp, _ = logprobs(rollout, 0.7)
    (logp * weights).sum().backward()
    return logp.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


TOKENS = SpecialTokens(eos_id=3, pad_id=0)


def _sample(model, prompts: torch.Tensor, mask: torch.Tensor, n: int, max_new_tokens: int,
            generator: torch.Generator, fast: PrefixSharedLM | None = None) -> Turn:
    """Rollouts of left-padded prompt ids through the plain engine, or the prompt-once one over `fast`."""
    engine = HFEngine(model, TOKENS) if fast is None else PrefixSharedEngine(fast, TOKENS)
    prompt_lists = [row[m.bool()].tolist() for row, m in zip(prompts, mask)]
    return engine.sample(prompt_lists, SamplingParams(n=n, max_new_tokens=max_new_tokens), generator)


def _assert_same_logprobs_and_grads(rollout: Turn, fast, reference) -> None:
    (fast_logp, fast_grads), (ref_logp, ref_grads) = fast, reference
    mask = rollout.completion_mask.bool()
    assert torch.allclose(fast_logp[mask], ref_logp[mask], atol=1e-5)
    for name, grad in ref_grads.items():
        assert torch.allclose(fast_grads[name], grad, atol=1e-5, rtol=1e-4), name


@pytest.mark.parametrize("attention_rows", ["group", "completion"])
@pytest.mark.parametrize("groups", [(0, 0, 1, 1, 1, 2), (0, 0, 1, 1, 2, 2)], ids=["unequal-groups", "equal-groups"])
@pytest.mark.parametrize("complex_rotary", [True, False], ids=["complex-rotary", "plain-rotary"])
@pytest.mark.parametrize("arch", list(ARCHITECTURES))
def test_logprobs_and_gradients_match_the_hugging_face_forward(arch, complex_rotary, groups, attention_rows):
    model = ARCHITECTURES[arch]()
    fast = checked_prefix_shared_lm(model)
    assert fast is not None, f"{arch}: the self-check refused a supported architecture"
    # float32 models without per-head q/k norms take the complex rotation (reordered q|k rows); Qwen3, Gemma 3 never.
    assert fast.pieces.rotates_as_complex(torch.float32) == (arch not in ("qwen3-qk-norm", "gemma3"))
    fast = fast.with_options(complex_rotary=complex_rotary, attention_rows=attention_rows)
    rollout = _rollout(groups)
    ref_logp, ref_grads = _logprobs_and_grads(model, rollout, lambda r, t: completion_logprobs(model, r, t))
    fast_logp, fast_grads = _logprobs_and_grads(model, rollout, fast.completion_logprobs)
    _assert_same_logprobs_and_grads(rollout, (fast_logp, fast_grads), (ref_logp, ref_grads))


def test_distinct_rows_by_hand():
    prompts = torch.tensor([[0, 5, 6], [0, 5, 6], [0, 5, 6], [7, 5, 6], [0, 5, 6], [0, 5, 6]])
    prompt_mask = torch.tensor([[0, 1, 1], [0, 1, 1], [0, 1, 1], [1, 1, 1], [1, 1, 1], [0, 1, 1]])
    completions = torch.tensor([[8, 3, 0], [8, 3, 9], [8, 9, 3], [8, 3, 0], [8, 3, 0], [8, 3, 0]])
    completion_mask = torch.tensor([[1, 1, 0], [1, 1, 0], [1, 1, 1], [1, 1, 0], [1, 1, 0], [1, 1, 0]])
    first, inverse = distinct_rows(prompts, prompt_mask, completions, completion_mask)
    # row 1 repeats row 0 (its token past the mask does not count), row 5 repeats row 0; row 2 has another
    # completion, row 3 another prompt, row 4 the same ids as row 0 with another prompt mask
    assert first.tolist() == [0, 2, 3, 4]
    assert inverse.tolist() == [0, 0, 1, 2, 3, 0]
    assert distinct_rows(prompts[2:5], prompt_mask[2:5], completions[2:5], completion_mask[2:5]) is None


@pytest.mark.parametrize("arch", ["llama-gqa-tied", "qwen2-bias-gqa"])
def test_repeated_rows_are_computed_once_with_the_same_logprobs_and_gradients(monkeypatch, arch):
    model = ARCHITECTURES[arch]()
    fast = checked_prefix_shared_lm(model)
    base = _rollout((0, 0, 1, 1, 2, 2))
    rows = torch.tensor([0, 0, 1, 2, 2, 2, 3, 4, 5, 4])  # groups 0, 1, 2 with repeated completions
    rollout = base.select(rows.tolist())
    seen = []
    states = fast._completion_states
    monkeypatch.setattr(fast, "_completion_states", lambda *a: seen.append(len(a[0])) or states(*a))
    ref_logp, ref_grads = _logprobs_and_grads(model, rollout, lambda r, t: completion_logprobs(model, r, t))
    fast_logp, fast_grads = _logprobs_and_grads(model, rollout, fast.completion_logprobs)
    assert seen == [6]  # 10 rows, 6 distinct
    _assert_same_logprobs_and_grads(rollout, (fast_logp, fast_grads), (ref_logp, ref_grads))
    assert torch.equal(fast_logp[0], fast_logp[1]) and torch.equal(fast_logp[3], fast_logp[5])
    fast = fast.with_options(distinct_rows=False)
    monkeypatch.setattr(fast, "_completion_states", lambda *a: seen.append(len(a[0])) or states(*a))
    assert torch.allclose(fast.completion_logprobs(rollout, 0.7)[0], fast_logp, atol=1e-6)
    assert seen == [6, 10]


def test_repeated_rows_are_computed_apart_while_dropout_is_active(monkeypatch):
    """Each row draws its own dropout masks in train mode (LoRA's dropout), so none can stand for another."""
    from components.config import LoRAConfig
    from components.engine.grpo.policy import attach_lora

    model = attach_lora(_llama(), LoRAConfig(enabled=True, rank=4, dropout=0.5, target_modules=["q_proj"]))
    fast = checked_prefix_shared_lm(model)
    rollout = _rollout((0, 0, 1, 1, 2, 2)).select([0, 0, 1, 2])
    seen = []
    states = fast._completion_states
    monkeypatch.setattr(fast, "_completion_states", lambda *a: seen.append(len(a[0])) or states(*a))
    model.train()
    fast.completion_logprobs(rollout)
    model.eval()
    fast.completion_logprobs(rollout)
    assert seen == [4, 3]


def test_group_rows_extra_work_by_hand():
    # 2 prompts of 3 positions, rows of 7 slots: 2 * 49 = 98 scores; 2 * 9 prompt scores + 4 completions x 2
    # tokens over 3 + 2 keys = 58; 40 more, each over 8 query-head dims
    assert group_rows_extra_work(prompts=2, width=3, length=7, rows=4, steps=2, head_width=8) == 320


def test_auto_takes_group_rows_only_while_they_add_little_attention_work(monkeypatch):
    from components.engine.generation.fast import attention

    model = _llama()
    fast = checked_prefix_shared_lm(model)
    taken = []
    group_rows = attention.group_rows
    monkeypatch.setattr(attention, "group_rows", lambda *a: taken.append(True) or group_rows(*a))
    rollout = _rollout()  # prompt 1's three rows feed 4 + 4 + 4 tokens: rows of 6 + 12 slots
    # 3 * 18 * 18 - (3 * 6 * 6 + 6 completions x 4 tokens over 6 + 4 keys) = 624 scores more, x 4 heads x 16 dims
    extra = 624 * 64
    with torch.no_grad():
        monkeypatch.setattr(attention, "GROUP_ROWS_EXTRA_WORK", extra)
        expected = fast.completion_logprobs(rollout)[0]
        assert taken, "at the limit: group rows"
        monkeypatch.setattr(attention, "GROUP_ROWS_EXTRA_WORK", extra - 1)
        taken.clear()
        assert torch.allclose(fast.completion_logprobs(rollout)[0], expected, atol=1e-5)
        assert not taken, "over the limit: completion rows"


def test_length_buckets_by_hand():
    from components.engine.generation.fast.attention import length_buckets

    # rows 0 and 3 feed 5 tokens, row 2 three, row 4 one, row 1 none; 2 cached prompt keys. One bucket: 4 rows x 5 x
    # (2 + 5) = 140 scores; {0, 3} {2, 4}: 2 x 35 + 2 x 3 x 5 = 100; {0, 3, 2} {4}: 105 + 3 = 108; so two calls cut
    # after the long rows, and three take {0, 3} {2} {4}: 70 + 15 + 3 = 88.
    lengths = torch.tensor([5, 0, 3, 5, 1])
    as_sets = lambda buckets: [set(b.tolist()) for b in buckets]  # noqa: E731
    assert as_sets(length_buckets(lengths, 2, calls=1)) == [{0, 2, 3, 4}]
    assert as_sets(length_buckets(lengths, 2, calls=2)) == [{0, 3}, {2, 4}]
    assert as_sets(length_buckets(lengths, 2, calls=3)) == [{0, 3}, {2}, {4}]
    assert as_sets(length_buckets(torch.tensor([4, 4, 4]), 2, calls=3)) == [{0, 1, 2}]  # nothing to save: one call


def _ragged_episodes() -> Turn:
    """EOS-ragged rows (1 to 11 scored tokens of one prompt's group) and a multi-turn row whose middle tokens (a
    tool's answer) are context, not the model's."""
    gen = torch.Generator().manual_seed(3)
    prompts = torch.randint(4, VOCAB, (2, 5), generator=gen)
    prompt_mask = torch.ones_like(prompts)
    prompt_mask[1, :2] = 0
    prompts = prompts * prompt_mask
    rows = torch.tensor([0, 0, 0, 1, 1, 1])
    completions = torch.randint(4, VOCAB, (6, 12), generator=gen)
    completion_mask = torch.zeros_like(completions)
    for row, length in enumerate([12, 2, 3, 12, 7, 1]):
        completion_mask[row, :length] = 1
    model_mask = completion_mask.clone()
    model_mask[3, 4:8] = 0  # row 3: a model turn, a tool's answer, a model turn
    return Turn(prompts[rows], prompt_mask[rows], completions * completion_mask, completion_mask,
                    torch.zeros(6, dtype=torch.bool), group_size=3, model_mask=model_mask)


@pytest.mark.parametrize("calls", [1, 2, 4])
def test_ragged_and_multi_turn_rows_match_the_hugging_face_forward_however_they_are_bucketed(monkeypatch, calls):
    """Completion rows in length buckets (one call padding every row to the longest, or several), each token
    attending only to its own row and prompt: log-probs (float32, within 1e-5) and gradients equal the plain forward's
    on EOS-ragged rows and a multi-turn row."""
    from components.engine.generation.fast import attention

    model = _llama(num_key_value_heads=2)
    fast = checked_prefix_shared_lm(model).with_options(attention_rows="completion")
    monkeypatch.setattr(attention, "RAGGED_CALLS", calls)
    rollout = _ragged_episodes()
    ref = _logprobs_and_grads(model, rollout, lambda r, t: completion_logprobs(model, r, t))
    _assert_same_logprobs_and_grads(rollout, _logprobs_and_grads(model, rollout, fast.completion_logprobs), ref)


def test_no_token_sees_another_row():
    """Changing one row's later tokens leaves every other row's log-probs, and its own earlier ones, as they were:
    a bucket's rows share one attention call but no keys."""
    model = _llama(num_key_value_heads=2)
    fast = checked_prefix_shared_lm(model).with_options(attention_rows="completion")
    rollout = _ragged_episodes()
    changed = rollout.completion_ids.clone()
    changed[0, 6:] = (changed[0, 6:] + 1) % VOCAB  # row 0 after column 6: same lengths, so the same buckets
    with torch.no_grad():
        before = fast.completion_logprobs(rollout)[0]
        after = fast.completion_logprobs(dataclasses.replace(rollout, completion_ids=changed))[0]
    assert torch.equal(after[1:], before[1:]) and torch.equal(after[0, :6], before[0, :6])
    assert not torch.allclose(after[0, 6:], before[0, 6:])


@pytest.mark.parametrize("arch", ["llama-gqa-tied", "qwen2-bias-gqa", "qwen3-qk-norm", "gemma2", "gemma3"])
def test_decoding_logits_match_a_full_forward_and_sampling_matches_the_plain_path(arch):
    model = ARCHITECTURES[arch]()
    fast = checked_prefix_shared_lm(model)
    prompts = torch.tensor([[0, 0, 5, 6, 7], [8, 9, 10, 11, 12]])
    mask = (prompts != 0).long()
    decoder = fast.start_decoding(prompts, mask, group_size=3, max_new_tokens=4)
    fed = torch.tensor([[13, 14, 15]] * 6)
    seen = [decoder.logits]
    for t in range(3):
        seen.append(decoder.feed(fed[:, t]))
    ids = torch.cat([prompts.repeat_interleave(3, 0), fed], 1)
    full_mask = torch.cat([mask.repeat_interleave(3, 0), torch.ones_like(fed)], 1)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=full_mask,
                       position_ids=(full_mask.cumsum(-1) - 1).clamp(min=0)).logits
    for t, step_logits in enumerate(seen):
        assert torch.allclose(step_logits, logits[:, prompts.shape[1] - 1 + t], atol=1e-4), f"decode step {t}"

    plain = _sample(model, prompts, mask, 4, 5, torch.Generator().manual_seed(7))
    quick = _sample(model, prompts, mask, 4, 5, torch.Generator().manual_seed(7), fast)
    assert torch.equal(plain.completion_ids, quick.completion_ids)
    assert torch.equal(plain.completion_mask, quick.completion_mask)


def test_sampling_under_inference_mode_leaves_the_loss_forward_and_backward_working():
    """The fast sampler runs under inference_mode: neither its rollout nor anything it cached may be an
    inference tensor, or the loss's backward (which saves the ids) would fail."""
    model = _llama()
    fast = PrefixSharedLM(model)  # no self-check: sampling is the first thing this instance ever runs
    prompts = torch.tensor([[0, 0, 5, 6, 7], [8, 9, 10, 11, 12]])
    mask = (prompts != 0).long()

    rollout = _sample(model, prompts, mask, 3, 4, torch.Generator().manual_seed(1), fast)
    tensors = (rollout.prompt_ids, rollout.prompt_mask, rollout.completion_ids, rollout.completion_mask,
               rollout.truncated)
    assert not any(t.is_inference() for t in tensors)
    model.train()
    logp, _ = fast.completion_logprobs(rollout)
    (logp * rollout.completion_mask).sum().backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.model.layers[0].parameters())


def test_unsupported_or_mismatching_models_fall_back(monkeypatch):
    from transformers import GPT2Config, GPT2LMHeadModel

    assert checked_prefix_shared_lm(
        GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=1, n_head=2))) is None
    model = _llama()
    assert checked_prefix_shared_lm(model) is not None
    pieces = ModelPieces.__init__

    def doubled_scale(self, *args):  # a wrong attention scale must fail the self-check, not train silently
        pieces(self, *args)
        self.scaling *= 2

    monkeypatch.setattr(ModelPieces, "__init__", doubled_scale)
    assert not check.matches_reference_forward(PrefixSharedLM(model), VOCAB)
    assert checked_prefix_shared_lm(model) is None


def test_a_rotary_embedding_the_complex_rotation_cannot_reproduce_falls_back_to_the_plain_one():
    model = _llama()
    rotary = model.model.rotary_emb
    original = rotary.forward

    def uneven_halves(x, position_ids):  # a made-up variant: the two halves of cos/sin rotate differently
        cos, sin = original(x, position_ids)
        half = cos.shape[-1] // 2
        return torch.cat([cos[..., :half], cos[..., half:].flip(-1)], -1), torch.cat([sin[..., :half],
                                                                                      sin[..., half:].flip(-1)], -1)

    rotary.forward = uneven_halves
    fast = checked_prefix_shared_lm(model)
    assert fast is not None and not fast.options.complex_rotary  # the plain rotation reproduces it, not the complex
    # The frozen reference (a copy, as GRPO builds it) must take the same, checked rotation.
    reference = copy.deepcopy(model)
    twin = fast.over(reference)
    assert not twin.options.complex_rotary
    rollout = _rollout()
    with torch.no_grad():
        expected = completion_logprobs(reference, rollout, 1.0)[0]
        got = twin.completion_logprobs(rollout, 1.0)[0]
    mask = rollout.completion_mask.bool()
    assert torch.allclose(got[mask], expected[mask], atol=1e-5)


ALL_PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@pytest.mark.parametrize("targets", [["q_proj", "v_proj"], ALL_PROJECTIONS], ids=["q-v", "all-projections"])
def test_lora_adapters_are_seen_and_can_be_disabled(targets):
    """Without a gradient (decoding, reference) LoRA projections run merged (W + s B A), with one they run as
    peft modules; both must give the peft model's own log-probs, with adapters on and off."""
    from components.config import LoRAConfig
    from components.engine.generation.fast.layers import plain_linear
    from components.engine.grpo.policy import attach_lora

    base = _llama()
    model = attach_lora(copy.deepcopy(base), LoRAConfig(enabled=True, rank=4, target_modules=targets))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)  # non-zero adapters, so they change the output
    fast = checked_prefix_shared_lm(model)
    assert fast is not None
    wrapped = model.get_base_model().model.layers[0].self_attn.q_proj
    assert plain_linear(wrapped) is None and plain_linear(wrapped, merge_lora=True) is not None
    rollout = _rollout()
    mask = rollout.completion_mask.bool()
    with torch.no_grad():
        expected = completion_logprobs(model, rollout)[0][mask]
        with_adapters = fast.completion_logprobs(rollout)[0]
        assert torch.allclose(with_adapters[mask], expected, atol=1e-5)
        with model.disable_adapter():
            without = fast.completion_logprobs(rollout)[0]
        assert torch.allclose(without[mask], completion_logprobs(base, rollout)[0][mask], atol=1e-5)
        assert not torch.allclose(with_adapters[mask], without[mask], atol=1e-3)
    with_gradient = fast.completion_logprobs(rollout)[0]  # modules, not merged: the adapters get gradients
    assert torch.allclose(with_gradient[mask], expected, atol=1e-5)
    with_gradient[mask].sum().backward()
    assert all(p.grad is not None for n, p in model.named_parameters() if "lora_" in n)


def test_lora_decoding_merges_the_adapters_and_samples_what_peft_samples():

    from components.config import LoRAConfig
    from components.engine.grpo.policy import attach_lora

    model = attach_lora(_llama(num_key_value_heads=2), LoRAConfig(enabled=True, rank=4, target_modules=ALL_PROJECTIONS))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)
    fast = checked_prefix_shared_lm(model)
    prompts = torch.tensor([[0, 0, 5, 6, 7], [8, 9, 10, 11, 12]])
    mask = (prompts != 0).long()

    plain = _sample(model, prompts, mask, 4, 6, torch.Generator().manual_seed(3))
    quick = _sample(model, prompts, mask, 4, 6, torch.Generator().manual_seed(3), fast)
    assert torch.equal(plain.completion_ids, quick.completion_ids)
    with torch.inference_mode():  # what decoding runs on: every projection merged into one matmul
        layers = fast.pieces.fused_weights(merge_lora=True)
    assert all(w.qkv is not None and w.o is not None and w.gate_up is not None and w.down is not None for w in layers)


def test_grpo_updates_are_the_same_with_and_without_prefix_sharing():
    from components.config import GRPOConfig
    from components.engine.grpo.policy import Policy
    from components.engine.grpo.trajectory import Trajectory
    from components.engine.grpo.update import policy_updates

    base = _llama(num_key_value_heads=2)
    rollout = dataclasses.replace(_rollout(), group_size=2)
    advantages = torch.tensor([1.0, -1.0, 0.5, -0.25, -0.25, 0.0])
    g = GRPOConfig(group_size=2, prompts_per_step=3, kl_beta=0.05, loss_type="dapo", max_grad_norm=1e9)
    reference = copy.deepcopy(base).requires_grad_(False)
    results = []
    for shared in (False, True):
        model = copy.deepcopy(base).train()
        engine = PrefixSharedEngine(PrefixSharedLM(model), TOKENS) if shared else HFEngine(model, TOKENS)
        policy = Policy.of(None, model, engine, reference)
        ref_logp = policy.reference_logprobs(rollout)
        opt = torch.optim.SGD(model.parameters(), lr=0.5)
        stats = policy_updates(policy, opt, Trajectory(rollout, advantages, rollout.completion_mask,
                                                         torch.ones(len(rollout), dtype=torch.bool), ref_logp), g)
        results.append((stats.loss, stats.entropy, [p.detach().clone() for p in model.parameters()]))
    (loss_a, ent_a, params_a), (loss_b, ent_b, params_b) = results
    assert loss_a == pytest.approx(loss_b, rel=1e-4, abs=1e-6) and ent_a == pytest.approx(ent_b, rel=1e-4)
    assert any(not torch.equal(p, q) for p, q in zip(params_a, base.parameters())), "no update happened"
    assert all(torch.allclose(p, q, atol=1e-5) for p, q in zip(params_a, params_b))


def test_decoding_drops_finished_rows_and_still_samples_what_the_plain_path_samples(monkeypatch):
    """Rows that emitted EOS leave the fast decoder's caches (`Decoder.keep`); the completions, masks and the
    generator's stream must stay those of the plain Hugging Face path, which decodes every row to the end."""

    from components.engine.generation.fast import decoder

    model = _llama(num_key_value_heads=2)
    with torch.no_grad():
        model.lm_head.weight[3] += 0.4 * model.model.embed_tokens.weight.sum(0)  # EOS (id 3) is drawn often
    fast = checked_prefix_shared_lm(model)
    prompts = torch.tensor([[0, 0, 5, 6, 7], [8, 9, 10, 11, 12], [0, 4, 9, 6, 5]])
    mask = (prompts != 0).long()

    kept = []
    original = decoder.Decoder.keep
    monkeypatch.setattr(decoder.Decoder, "keep", lambda self, rows: (kept.append(len(rows)), original(self, rows)))
    plain_gen, fast_gen = torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)
    plain = _sample(model, prompts, mask, 6, 10, plain_gen)
    quick = _sample(model, prompts, mask, 6, 10, fast_gen, fast)
    lengths = plain.completion_mask.sum(-1)
    assert lengths.min() < lengths.max(), "every row ended at the same step: nothing to drop"
    assert kept, "no finished row was dropped"
    assert torch.equal(plain.completion_ids, quick.completion_ids)
    assert torch.equal(plain.completion_mask, quick.completion_mask)
    assert torch.equal(plain_gen.get_state(), fast_gen.get_state())


def test_shared_prefix_length_by_hand():
    from components.engine.generation.fast.rows import shared_prefix_length

    ids = torch.tensor([[0, 0, 7, 7, 5, 6, 1],    # real: 7 7 5 6 1
                        [7, 7, 5, 6, 2, 3, 4],    # real: 7 7 5 6 2 3 4
                        [0, 7, 7, 5, 9, 9, 9]])   # real: 7 7 5 9 9 9
    mask = (ids != 0).long()
    assert shared_prefix_length(ids, mask) == 3  # "7 7 5"
    assert shared_prefix_length(ids[:2], mask[:2]) == 4  # "7 7 5 6"
    same = torch.tensor([[7, 7, 5], [7, 7, 5]])
    assert shared_prefix_length(same, torch.ones_like(same)) == 2  # each row keeps one token of its own
    assert shared_prefix_length(ids[:1], mask[:1]) == 0  # one prompt: nothing to share


def _rollout_with_shared_prefix(rows: tuple[int, ...] = (0, 0, 1, 1, 1, 2)) -> Turn:
    """Three left-padded prompts whose real tokens share their first 10 (a system prompt, say)."""
    gen = torch.Generator().manual_seed(2)
    head = torch.randint(4, VOCAB, (10,), generator=gen)
    own = [torch.randint(4, VOCAB, (n,), generator=gen) for n in (2, 5, 3)]
    width = 15
    prompts = torch.zeros(3, width, dtype=torch.long)
    for i, tail in enumerate(own):
        real = torch.cat([head, tail])
        prompts[i, width - len(real):] = real
    prompt_mask = (torch.arange(width) >= width - torch.tensor([12, 15, 13])[:, None]).long()
    rows = torch.tensor(rows)
    completions = torch.randint(4, VOCAB, (len(rows), 5), generator=gen)
    completion_mask = torch.ones_like(completions)
    completion_mask[1, 2:] = 0
    completion_mask[-2, 4:] = 0
    completions = completions * completion_mask
    return Turn(prompts[rows], prompt_mask[rows], completions, completion_mask,
                    torch.zeros(len(rows), dtype=torch.bool))


@pytest.mark.parametrize("groups", [(0, 0, 1, 1, 1, 2), (0, 0, 1, 1, 2, 2)], ids=["unequal-groups", "equal-groups"])
@pytest.mark.parametrize("arch", list(ARCHITECTURES))
def test_a_shared_prompt_prefix_is_encoded_once_with_the_same_logprobs_and_gradients(monkeypatch, arch, groups):
    from components.engine.generation.fast import prompts as prompt_module

    model = ARCHITECTURES[arch]()
    fast = checked_prefix_shared_lm(model, max_length=20, completion_length=5)
    assert fast is not None
    prefixes = []
    original = prompt_module._prompt_pass_of

    def spy(pieces, ids, mask, prefix):  # records how many shared tokens each prompt pass attends to
        prefixes.append(None if prefix is None else prefix[0][0].shape[2])
        return original(pieces, ids, mask, prefix)

    monkeypatch.setattr(prompt_module, "_prompt_pass_of", spy)
    rollout = _rollout_with_shared_prefix(groups)
    ref_logp, ref_grads = _logprobs_and_grads(model, rollout, lambda r, t: completion_logprobs(model, r, t))
    prefixes.clear()
    fast_logp, fast_grads = _logprobs_and_grads(model, rollout, fast.completion_logprobs)
    assert prefixes == [None, 10], "the 10 shared tokens were not encoded once"
    _assert_same_logprobs_and_grads(rollout, (fast_logp, fast_grads), (ref_logp, ref_grads))


def test_decoding_after_a_shared_prefix_matches_a_full_forward():
    model = ARCHITECTURES["llama-gqa-tied"]()
    fast = checked_prefix_shared_lm(model, max_length=20, completion_length=5)
    rollout = _rollout_with_shared_prefix((0, 1, 2))
    prompts, mask = rollout.prompt_ids, rollout.prompt_mask
    decoder = fast.start_decoding(prompts, mask, group_size=2, max_new_tokens=4)
    fed = torch.tensor([[13, 14, 15]] * 6)
    seen = [decoder.logits] + [decoder.feed(fed[:, t]) for t in range(3)]
    ids = torch.cat([prompts.repeat_interleave(2, 0), fed], 1)
    full_mask = torch.cat([mask.repeat_interleave(2, 0), torch.ones_like(fed)], 1)
    positions = (full_mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=full_mask, position_ids=positions).logits
    for t, step_logits in enumerate(seen):
        assert torch.allclose(step_logits, logits[:, prompts.shape[1] - 1 + t], atol=1e-4), f"decode step {t}"


def test_the_self_check_covers_the_shared_prefix_path(monkeypatch):
    model = _llama()
    assert checked_prefix_shared_lm(model, max_length=20, completion_length=5) is not None
    from components.engine.generation.fast import attention
    from components.engine.generation.fast import prompts as prompt_module

    broken = PrefixSharedLM(model)
    original = prompt_module.prompt_layer

    def misplaced(pieces, prompts, i, q, k, v):  # the rest of each prompt attends wrongly after the prefix
        attn, cache = original(pieces, prompts, i, q, k, v)
        return (attn * 1.5, cache) if prompts.prefix is not None else (attn, cache)

    monkeypatch.setattr(prompt_module, "prompt_layer", misplaced)
    monkeypatch.setattr(attention, "prompt_layer", misplaced)
    assert check.matches_reference_forward(broken, VOCAB, prompt_length=5)  # too short to share: path unused
    assert not check.matches_reference_forward(broken, VOCAB, prompt_length=15)


@pytest.mark.parametrize("width", [1, 5, 12, 15, 16, 40])
def test_short_softmax_rows_padded_for_speed_give_torch_softmax_and_its_gradient(width):
    """Rows under 16 values are padded with -inf for PyTorch's fast CPU kernel: values and gradients unchanged,
    also with a fully masked row (the attention bias's finite minimum everywhere)."""
    gen = torch.Generator().manual_seed(width)
    scores = torch.randn(3, 2, 4, width, generator=gen)
    scores[0, 0, 0] = torch.finfo(torch.float32).min
    upstream = torch.randn(3, 2, 4, width, generator=gen)
    mine, ref = scores.clone().requires_grad_(), scores.clone().requires_grad_()
    out = ModelPieces._softmax(mine)
    expected = torch.softmax(ref, dim=-1)
    (out * upstream).sum().backward()
    (expected * upstream).sum().backward()
    assert out.shape == expected.shape
    torch.testing.assert_close(out, expected, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(mine.grad, ref.grad, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("arch", ["llama-gqa-tied", "qwen2-bias-gqa", "qwen3-qk-norm", "gemma2", "gemma3"])
def test_chunked_head_and_checkpointed_layers_match_the_hugging_face_forward(monkeypatch, arch):
    """The long-completion memory levers (vocabulary head in chunks of 2 rows, each decoder layer recomputed in
    backward) on both paths: the same log-probs and gradients as the plain Hugging Face forward without them."""
    from components.engine.generation import logprobs
    from components.engine.models.modeling import checkpointable_layers, layer_checkpointing

    model = ARCHITECTURES[arch]().train()
    rollout = _rollout()
    reference = _logprobs_and_grads(model, rollout, lambda r, t: completion_logprobs(model, r, t))
    monkeypatch.setattr(logprobs, "LOGITS_BUDGET_BYTES", 4 * VOCAB)  # more than one row: chunks
    monkeypatch.setattr(logprobs, "LOGITS_CHUNK_BYTES", 4 * VOCAB * 2)
    fast = checked_prefix_shared_lm(model).with_options(gradient_checkpointing=True)
    _assert_same_logprobs_and_grads(rollout, _logprobs_and_grads(model, rollout, fast.completion_logprobs), reference)
    assert len(checkpointable_layers(model)) == len(model.model.layers)

    def plain(r, t):
        with layer_checkpointing(model, True):
            return completion_logprobs(model, r, t)

    _assert_same_logprobs_and_grads(rollout, _logprobs_and_grads(model, rollout, plain), reference)
    assert not model.model.layers[0].gradient_checkpointing, "switched off again after the forward"


def _saved_numel(forward) -> int:
    """Elements autograd keeps for backward while `forward()` runs."""
    sizes = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: sizes.append(t.numel()) or t, lambda t: t):
        forward()
    return sum(sizes)


def test_checkpointing_keeps_about_one_layers_activations_on_both_paths():
    """With gradient checkpointing the tensors kept for backward shrink to the layers' inputs (a tenth here)."""
    from components.engine.models.modeling import layer_checkpointing

    model = _llama().train()
    rollout = _rollout()
    fast = checked_prefix_shared_lm(model)

    def fast_forward(checkpointing: bool):
        return lambda: fast.with_options(gradient_checkpointing=checkpointing).completion_logprobs(rollout)

    def plain_forward(checkpointing: bool):
        def run():
            with layer_checkpointing(model, checkpointing):
                completion_logprobs(model, rollout)
        return run

    for forward in (fast_forward, plain_forward):
        assert _saved_numel(forward(True)) < _saved_numel(forward(False)) / 3, forward.__name__


def test_the_decoding_cache_grows_as_tokens_are_decoded(monkeypatch):
    """The decoder's KV cache starts with room for a block of tokens and grows when full; the tokens sampled are
    those of the plain path, and the cache never holds more than twice what was decoded (plus the block)."""
    from components.engine.generation.fast import decoder

    monkeypatch.setattr(decoder, "DECODE_CACHE_BLOCK", 2)
    model = _llama()
    fast = checked_prefix_shared_lm(model)
    prompts = torch.tensor([[0, 0, 5, 6, 7], [8, 9, 10, 11, 12]])
    mask = (prompts != 0).long()
    decoder = fast.start_decoding(prompts, mask, group_size=2, max_new_tokens=9)
    capacities = []
    for t in range(8):
        decoder.feed(torch.full((4,), 13 + t))
        capacities.append(decoder.buffers[0][0].shape[2] - prompts.shape[1])
    assert capacities == [2, 2, 4, 4, 8, 8, 8, 8]
    plain = _sample(model, prompts, mask, 3, 12, torch.Generator().manual_seed(5))
    quick = _sample(model, prompts, mask, 3, 12, torch.Generator().manual_seed(5), fast)
    assert plain.completion_ids.shape[1] > 4, "the rollout should outgrow the first blocks"
    assert torch.equal(plain.completion_ids, quick.completion_ids)


def test_the_same_completion_in_two_groups_with_different_advantages_updates_as_the_plain_path():
    """Two groups of the same prompt share one completion (computed once by the prompt-once forward) but give it
    opposite advantages: the update must weigh each copy by its own advantage, as the plain forward does."""
    from components.config import GRPOConfig
    from components.engine.grpo.policy import Policy
    from components.engine.grpo.trajectory import Trajectory
    from components.engine.grpo.update import policy_updates

    base = _llama(num_key_value_heads=2)
    rows = _rollout((0, 0, 0, 0, 0, 0))
    same = dataclasses.replace(rows.select([0, 1, 0, 2]), group_size=2)  # groups (0, 1), (0, 2): row 2 repeats row 0
    advantages = torch.tensor([1.0, -1.0, -0.25, 0.25])
    g = GRPOConfig(group_size=2, prompts_per_step=2, kl_beta=0.0, loss_type="dapo", max_grad_norm=1e9)
    results = []
    for shared in (False, True):
        model = copy.deepcopy(base).train()
        policy = Policy.of(None, model, PrefixSharedEngine(PrefixSharedLM(model), TOKENS) if shared
                           else HFEngine(model, TOKENS))
        if shared:
            assert distinct_rows(same.prompt_ids, same.prompt_mask, same.completion_ids,
                                 same.completion_mask)[0].tolist() == [0, 1, 3]
        opt = torch.optim.SGD(model.parameters(), lr=0.5)
        policy_updates(policy, opt, Trajectory(same, advantages, same.completion_mask,
                                               torch.ones(len(same), dtype=torch.bool)), g)
        results.append([p.detach().clone() for p in model.parameters()])
    plain, shared = results
    assert any(not torch.equal(p, q) for p, q in zip(plain, base.parameters())), "no update happened"
    assert all(torch.allclose(p, q, atol=1e-6) for p, q in zip(plain, shared))


def test_the_self_check_sees_a_group_rows_fault_on_long_rows_and_a_fault_at_long_positions(monkeypatch):
    """Long rows run in completion rows only; both layouts run short (check.py): a fault in group rows is still
    caught when the engine's rows are long, and one that shows only past the short rows' positions too."""
    from components.engine.generation.fast import attention, pieces

    model = _llama()
    assert check.matches_reference_forward(PrefixSharedLM(model), VOCAB, prompt_length=48, completion_length=8)
    original_group = attention.group_rows

    def leaky(pieces_, prompts, rows, per_group, length, fed_rows, fed_cols):  # scores skewed in every group row
        attend = original_group(pieces_, prompts, rows, per_group, length, fed_rows, fed_cols)
        return lambda i, heads: attend(i, heads) * 1.01

    with monkeypatch.context() as patched:
        patched.setattr(attention, "group_rows", leaky)
        assert not check.matches_reference_forward(PrefixSharedLM(model), VOCAB, prompt_length=48,
                                                   completion_length=8)
    original_positions = pieces.ModelPieces.positions

    def far_off(self, x, position_ids):  # every position past 30 rotated as 30: wrong only beyond the short rows
        return original_positions(self, x, position_ids.clamp(max=30))

    monkeypatch.setattr(pieces.ModelPieces, "positions", far_off)
    assert not check.matches_reference_forward(PrefixSharedLM(model), VOCAB, prompt_length=48, completion_length=8)
