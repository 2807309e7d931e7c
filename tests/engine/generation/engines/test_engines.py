"""Every rollout engine against the plain Hugging Face one, through the door the algorithm uses.

Each test runs once per entry of components/rollout_engines.py, built by its module's `conformance`: the same generator
state must give the same tokens, masks and sampler log-probs as the plain path (greedy and sampled, with finished
rows, LoRA adapters and the row layout), and the engine's log-probs must be the plain forward's. A new engine's entry
puts it here; nothing in this file names one.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import pytest
import torch

from components.engine.generation.engines.base import EngineRun, RolloutEngine, SamplingParams, SpecialTokens
from components.engine.generation.engines.choose import conformance_engine
from components.engine.generation.logprobs import completion_logprobs
from components.rollout_engines import ENGINES as ENTRIES

VOCAB = 24
TOKENS = SpecialTokens(eos_id=3, pad_id=0)


RUN = EngineRun(vocab_size=VOCAB, max_length=30, completion_length=12)
PLAIN = next(iter(ENTRIES))  # the registry's fallback, the reference the others are checked against


def _builder(name: str) -> Callable[[Any, SpecialTokens], RolloutEngine]:
    return lambda model, tokens: conformance_engine(model, tokens, RUN, name)


ENGINES: dict[str, Callable[[Any, SpecialTokens], RolloutEngine]] = {name: _builder(name) for name in ENTRIES}


def _llama(eos_bias: float = 0.0, **extra):
    """A small random Llama; `eos_bias` makes EOS (id 3) likely, so rows finish at different steps."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                         **extra)).eval()
    with torch.no_grad():
        model.lm_head.weight[3] += eos_bias * model.model.embed_tokens.weight.sum(0)
    return model


def _lora(quantize_base: str = "none", device: str = "cpu", dtype: torch.dtype = torch.float32):
    """LoRA over `_llama(0.4)`, the base moved to `device` and `dtype` first: a 4-bit base is quantized where it runs,
    as the pipeline quantizes it (a later move with a dtype could dequantize it)."""
    from components.config import LoRAConfig
    from components.engine.grpo.policy import attach_lora

    projections = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    model = attach_lora(_llama(0.4).to(device, dtype),
                        LoRAConfig(enabled=True, rank=4, quantize_base=quantize_base, target_modules=projections))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)
    return model


def gemma(version: int, eos_bias: float = 0.4, seed: int = 0, **shape: Any):
    """A small random Gemma 2 (soft-capped scores and logits) or Gemma 3 (query/key norms, a rotary table per
    attention type) from `seed`, its (1 + w) norms random too; `eos_bias` as in `_llama`; `shape` overrides the
    config's sizes (test_half_precision.py builds a wider one)."""
    from transformers import Gemma2Config, Gemma2ForCausalLM, Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(seed)
    shape = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=16, sliding_window=64,
                 max_position_embeddings=64, initializer_range=0.1, attn_implementation="eager") | shape
    model = (Gemma2ForCausalLM(Gemma2Config(**shape, attn_logit_softcapping=5.0, final_logit_softcapping=8.0))
             if version == 2 else Gemma3ForCausalLM(Gemma3TextConfig(
                 **shape, layer_types=["sliding_attention", "full_attention"])))
    with torch.no_grad():
        for name, weight in model.named_parameters():
            if "norm" in name:
                weight.normal_(0.0, 0.3)
        if eos_bias:
            model.lm_head.weight[3] += eos_bias * model.model.embed_tokens.weight.sum(0) / 8
    return model.eval()


MODELS = {"llama": lambda: _llama(0.4), "llama-tied": lambda: _llama(0.4, tie_word_embeddings=True), "lora": _lora,
          "lora-nf4": lambda: _lora("nf4"),  # a 4-bit frozen base (grpo.lora.quantize_base)
          "gemma2": lambda: gemma(2), "gemma3": lambda: gemma(3)}
PROMPTS = [[5, 6, 7], [8, 9, 10, 11, 12], [4, 9, 6, 5]]  # different lengths: left padding


def _sample(name: str, model: Any, params: SamplingParams, seed: int = 5):
    engine = ENGINES[name](model, TOKENS)
    generator = torch.Generator().manual_seed(seed)
    return engine.sample(PROMPTS, params, generator), generator


@pytest.mark.parametrize("greedy", [False, True], ids=["sampled", "greedy"])
@pytest.mark.parametrize("model_name", list(MODELS))
@pytest.mark.parametrize("engine", [e for e in ENGINES if e != PLAIN])
def test_the_same_seed_gives_the_plain_paths_tokens(engine, model_name, greedy):
    model = MODELS[model_name]()
    params = SamplingParams(n=4, max_new_tokens=10, temperature=0.9, greedy=greedy)
    plain, plain_gen = _sample(PLAIN, model, params)
    ours, our_gen = _sample(engine, model, params)
    lengths = plain.completion_mask.sum(-1)
    assert greedy or lengths.min() < lengths.max(), "every row ended at the same step: finished rows never tested"
    assert torch.equal(ours.completion_ids, plain.completion_ids)
    assert torch.equal(ours.completion_mask, plain.completion_mask)
    assert torch.equal(ours.truncated, plain.truncated)
    assert torch.equal(ours.prompt_ids, plain.prompt_ids) and torch.equal(ours.prompt_mask, plain.prompt_mask)
    assert torch.equal(our_gen.get_state(), plain_gen.get_state()), "the generator was consumed differently"
    if greedy:
        assert ours.sampling_logp is None and plain.sampling_logp is None
    else:
        torch.testing.assert_close(ours.sampling_logp, plain.sampling_logp, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("engine", list(ENGINES))
def test_rollouts_own_their_group_layout_and_sampler_logprobs(engine):
    model = _llama(0.4)
    rollouts, _ = _sample(engine, model, SamplingParams(n=3, max_new_tokens=8, temperature=0.7, top_k=5))
    assert len(rollouts) == 9 and rollouts.group_size == 3 and rollouts.num_groups == 3
    assert rollouts.group_rows([1]) == [3, 4, 5]
    for row in range(9):  # each group's rows hold its prompt, left-padded
        prompt = PROMPTS[row // 3]
        assert rollouts.prompt_ids[row][rollouts.prompt_mask[row].bool()].tolist() == prompt
    for ids, mask, truncated in zip(rollouts.completion_ids.tolist(), rollouts.completion_mask.tolist(),
                                    rollouts.truncated.tolist()):
        if TOKENS.eos_id in ids:  # every token up to and including the first EOS; padding after it
            k = ids.index(TOKENS.eos_id)
            assert mask == [1] * (k + 1) + [0] * (len(ids) - k - 1) and not truncated
            assert all(t == TOKENS.pad_id for t in ids[k + 1:])
        else:
            assert all(mask) and truncated
    # the sampler's log-probs are those of the full distribution at the temperature (what the loss scores)
    expected, _ = completion_logprobs(model, rollouts, 0.7)
    mask = rollouts.completion_mask.bool()
    torch.testing.assert_close(rollouts.sampling_logp[mask], expected[mask], atol=1e-5, rtol=1e-5)
    assert not any(t.is_inference() for t in (rollouts.prompt_ids, rollouts.completion_ids, rollouts.completion_mask))


@pytest.mark.parametrize("engine", list(ENGINES))
def test_logprobs_and_gradients_are_the_plain_forwards(engine):
    model = _llama(0.4).train()
    rollouts, _ = _sample(PLAIN, model, SamplingParams(n=2, max_new_tokens=6))
    weights = torch.linspace(-1, 1, len(rollouts))[:, None] * rollouts.completion_mask

    def logprobs_and_grads(score: Callable[[], tuple[torch.Tensor, torch.Tensor | None]]):
        model.zero_grad()
        logp, entropy = score()
        (logp * weights).sum().backward()
        return logp.detach(), entropy, [p.grad.clone() for p in model.parameters()]

    ours = logprobs_and_grads(lambda: ENGINES[engine](model, TOKENS).logprobs(rollouts, 0.8, with_entropy=True))
    plain = logprobs_and_grads(lambda: completion_logprobs(model, rollouts, 0.8, with_entropy=True))
    mask = rollouts.completion_mask.bool()
    torch.testing.assert_close(ours[0][mask], plain[0][mask], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ours[1][mask], plain[1][mask], atol=1e-5, rtol=1e-5)
    for a, b in zip(ours[2], plain[2]):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("engine", list(ENGINES))
def test_an_engine_over_another_model_scores_with_that_model(engine):
    """`over(reference)`: the same engine and options over the frozen reference (the KL term's log-probs)."""
    model, reference = _llama(0.4), _llama(0.4, rope_theta=500.0)
    with torch.no_grad():
        for p in reference.parameters():
            p.add_(0.01)
    rollouts, _ = _sample(PLAIN, model, SamplingParams(n=2, max_new_tokens=6))
    ours = ENGINES[engine](model, TOKENS).over(reference).logprobs(rollouts, 1.0)[0]
    mask = rollouts.completion_mask.bool()
    torch.testing.assert_close(ours[mask], completion_logprobs(reference, rollouts)[0][mask], atol=1e-5, rtol=1e-5)
    assert not torch.allclose(ours[mask], completion_logprobs(model, rollouts)[0][mask], atol=1e-3)


ANSWERS = [[7, 8], [9], [10, 11], [12]]  # what an environment writes between turns (ragged: one chunk a row)


def _three_turns(decoding, params: SamplingParams, generator: torch.Generator, after_first=lambda: None) -> list:
    """Three turns; after each, the rows that ended with EOS but the first go on with an answer each. At least one row
    that goes on ended at its turn's last step (the token loop draws that token but never feeds it)."""
    turns = [decoding.turn(params, generator)]
    after_first()
    ended_last = 0
    for _ in range(2):
        last = turns[-1]
        ended = [r for r in range(len(last)) if not last.truncated[r]]
        going = ended[1:] or ended
        assert going, "no row ended its turn: nothing to continue"
        ended_last += sum(int(last.completion_mask[r].sum()) == last.completion_ids.shape[1] for r in going)
        decoding.extend(going, [ANSWERS[k % len(ANSWERS)] for k in going], params.max_new_tokens)
        turns.append(decoding.turn(dataclasses.replace(params, n=1), generator))
    assert ended_last, "no row that went on ended at its turn's last step: its unfed token is never tested"
    return turns


@pytest.mark.parametrize("greedy", [False, True], ids=["sampled", "greedy"])
@pytest.mark.parametrize("engine", list(ENGINES))
def test_a_continued_conversation_draws_what_reencoding_it_draws(engine, greedy):
    """Three turns on one decoding run (each row's answer appended to its cache) against the same turns with every
    context encoded again (`turns.Reencoding`, what TRL's tool loop does): the same tokens, sampler log-probs and
    generator use in float32; and after the first turn no forward re-reads a context (only new tokens are fed)."""
    from components.engine.generation.engines.turns import Reencoding

    model = _llama(1.2)
    built = ENGINES[engine](model, TOKENS)
    params = SamplingParams(n=2, max_new_tokens=12, temperature=0.9, greedy=greedy)
    widths: list[int] = []
    hook = model.model.embed_tokens.register_forward_hook(lambda m, args, out: widths.append(args[0].shape[-1]))
    try:
        gen = torch.Generator().manual_seed(3)
        continued = _three_turns(built.start(PROMPTS, continuing=True), params, gen, after_first=widths.clear)
    finally:
        hook.remove()
    ref_gen = torch.Generator().manual_seed(3)
    reencoded = _three_turns(Reencoding(built, PROMPTS), params, ref_gen)
    assert len(continued) == len(reencoded) == 3
    for ours, theirs in zip(continued, reencoded):
        assert torch.equal(ours.completion_ids, theirs.completion_ids)
        assert torch.equal(ours.completion_mask, theirs.completion_mask)
        if not greedy:
            torch.testing.assert_close(ours.sampling_logp, theirs.sampling_logp, atol=1e-5, rtol=1e-5)
    assert torch.equal(gen.get_state(), ref_gen.get_state()), "the generator was consumed differently"
    longest_chunk = 1 + max(len(a) for a in ANSWERS)  # a row's unfed last token and its answer
    assert widths and max(widths) <= longest_chunk, f"a later turn re-read a context: widths {sorted(set(widths))}"

