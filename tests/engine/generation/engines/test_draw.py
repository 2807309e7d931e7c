"""Drawing tokens (components/engine/generation/engines/draw.py) and the plain engine on the char-level tiny model: the
draws against their distributions and Hugging Face's filters, greedy decoding against `generate`, log-probs against an
unpadded forward."""

import pytest
import torch

from components.engine.generation.engines.base import SamplingParams
from components.engine.generation.engines.draw import filter_top_k, filter_top_p, sample_from
from components.engine.generation.logprobs import completion_logprobs
from components.engine.generation.rollouts import decode_completions
from components.engine.models.modeling import (
    load_model,
    load_tokenizer,
)
from tests.engine.sampling import sample_texts, saved_tiny_model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return saved_tiny_model(tmp_path_factory.mktemp("tiny"))


def test_sampled_completions_logprobs_match_unpadded_forward(tiny):
    tok, model = load_tokenizer(tiny), load_model(tiny, torch.device("cpu"))
    rollout = sample_texts(model, tok, ["1+1=", "12+34=", "99+1="], SamplingParams(n=4, max_new_tokens=5),
                           torch.Generator().manual_seed(0))
    logp, _ = completion_logprobs(model, rollout)
    for i in range(rollout.input_ids.shape[0]):
        ids = rollout.input_ids[i][rollout.attention_mask[i].bool()]
        p, t = int(rollout.prompt_mask[i].sum()), int(rollout.completion_mask[i].sum())
        logits = model(input_ids=ids[None]).logits[0]
        ref = torch.log_softmax(logits[p - 1: p - 1 + t], -1).gather(-1, ids[p: p + t, None]).squeeze(-1)
        assert torch.allclose(logp[i, :t], ref, atol=1e-5)


def test_group_expansion_gives_each_prompt_its_own_cache(tiny):
    tok, model = load_tokenizer(tiny), load_model(tiny, torch.device("cpu"))
    prompts = ["1+1=", "12+34=", "99+1=", "7+8="]
    one = decode_completions(tok, sample_texts(model, tok, prompts, SamplingParams(max_new_tokens=5, greedy=True)))
    four = decode_completions(tok, sample_texts(model, tok, prompts, SamplingParams(n=4, max_new_tokens=5,
                                                                                     greedy=True)))
    assert four == [c for c in one for _ in range(4)]


def test_greedy_matches_transformers_generate(tiny):
    tok, model = load_tokenizer(tiny), load_model(tiny, torch.device("cpu"))
    prompts = ["1+1=", "12+34=", "99+1=", "7+8="]
    ours = decode_completions(tok, sample_texts(model, tok, prompts, SamplingParams(max_new_tokens=5, greedy=True)))
    enc = tok(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
    out = model.generate(**enc, max_new_tokens=5, do_sample=False, pad_token_id=tok.pad_token_id,
                         eos_token_id=tok.eos_token_id)
    theirs = [tok.decode(row[: list(row).index(tok.eos_token_id)] if tok.eos_token_id in row else row,
                         skip_special_tokens=True) for row in out[:, enc.input_ids.shape[1]:].tolist()]
    assert ours == theirs


def test_completion_mask_stops_after_eos(tiny):
    tok, model = load_tokenizer(tiny), load_model(tiny, torch.device("cpu"))
    rollout = sample_texts(model, tok, ["1+1="] * 8, SamplingParams(n=4, max_new_tokens=6),
                           torch.Generator().manual_seed(3))
    for ids, mask, truncated in zip(rollout.completion_ids.tolist(), rollout.completion_mask.tolist(),
                                    rollout.truncated.tolist()):
        if tok.eos_token_id in ids:
            k = ids.index(tok.eos_token_id)
            assert mask == [1] * (k + 1) + [0] * (len(ids) - k - 1) and not truncated
        else:
            assert all(mask) and truncated


def test_sample_from_draws_each_token_at_its_probability():
    probs = torch.tensor([[0.1, 0.0, 0.2, 0.7], [2.0, 0.0, 0.0, 2.0]])  # row 1 unnormalised: 1/2, 1/2
    gen = torch.Generator().manual_seed(0)
    draws = torch.stack([sample_from(probs, gen) for _ in range(20_000)])
    freq0 = torch.bincount(draws[:, 0], minlength=4).float() / len(draws)
    freq1 = torch.bincount(draws[:, 1], minlength=4).float() / len(draws)
    # 20,000 draws: standard error <= 0.0036, so 0.015 is over four of them
    assert torch.allclose(freq0, torch.tensor([0.1, 0.0, 0.2, 0.7]), atol=0.015)
    assert torch.allclose(freq1, torch.tensor([0.5, 0.0, 0.0, 0.5]), atol=0.015)
    assert freq0[1] == 0 and freq1[1] == 0 and freq1[2] == 0  # probability 0 is never drawn


def test_sample_from_a_uniform_rounding_up_to_the_total_takes_the_last_possible_token(monkeypatch):
    probs = torch.tensor([[0.25, 0.75, 0.0, 0.0]])
    monkeypatch.setattr(torch, "rand", lambda shape, **kw: torch.ones(shape, dtype=kw.get("dtype")))
    assert sample_from(probs).tolist() == [1]  # not the zero-probability tail


def _one_cumulative_sum(probs: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """The inversion `sample_from` replaces: one float64 cumulative sum over the whole vocabulary."""
    cdf = probs.cumsum(-1, dtype=torch.float64)
    total = cdf[:, -1:].contiguous()
    drawn = torch.searchsorted(cdf, torch.rand(total.shape, generator=generator, dtype=torch.float64) * total,
                               right=True)
    return torch.where(drawn >= probs.shape[-1], torch.searchsorted(cdf, total), drawn).squeeze(-1)


@pytest.mark.parametrize("vocab", [5000, 5120, 300])
def test_the_two_level_draw_takes_the_same_tokens_as_one_cumulative_sum(vocab):
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(32, vocab, generator=gen) * 3
    logits[:, 1000:2000] = float("-inf")  # whole blocks of probability 0 (top-k, top-p)
    probs = torch.softmax(logits, -1)
    for seed in range(100):
        got = sample_from(probs, torch.Generator().manual_seed(seed))
        assert torch.equal(got, _one_cumulative_sum(probs, torch.Generator().manual_seed(seed))), seed
        assert bool((probs.gather(-1, got[:, None]) > 0).all())


def test_a_uniform_rounding_up_past_the_last_block_takes_the_last_possible_token(monkeypatch):
    probs = torch.zeros(1, 600)
    probs[0, 3], probs[0, 300] = 0.5, 0.5  # blocks of 256: tokens 512-599 (the last block) have probability 0
    monkeypatch.setattr(torch, "rand", lambda shape, **kw: torch.ones(shape, dtype=kw.get("dtype")))
    assert sample_from(probs).tolist() == [300]


@pytest.mark.parametrize("top_k, top_p", [(3, 1.0), (1, 1.0), (5, 0.6), (0, 0.6), (12, 1.0)])
def test_top_k_and_top_p_keep_the_tokens_hugging_face_keeps(top_k, top_p):
    """The sampler's filters against transformers' TopKLogitsWarper then TopPLogitsWarper (its order), ties included."""
    from transformers.generation.logits_process import TopKLogitsWarper, TopPLogitsWarper

    gen = torch.Generator().manual_seed(4)
    logits = torch.randn(6, 12, generator=gen)
    logits[0, 3] = logits[0, 7] = logits[0].max() + 1.0  # a tie at the top
    ours = filter_top_k(logits, top_k)
    theirs = logits.clone()
    if top_k:
        theirs = TopKLogitsWarper(top_k)(None, theirs)
    if top_p < 1.0:
        ours, theirs = filter_top_p(ours, top_p), TopPLogitsWarper(top_p)(None, theirs)
    assert torch.equal(torch.isinf(ours), torch.isinf(theirs))
    kept = (~torch.isinf(ours)).sum(-1)
    assert (kept <= max(top_k, 2) if top_k else kept < 12).all() and (kept >= 1).all()


def test_top_k_sampling_draws_what_hugging_face_sampling_draws(tiny):
    """20,000 first tokens sampled with top-k 3 at temperature 0.8: the same frequencies as multinomial draws from
    Hugging Face's warped distribution, and never a token outside the top 3."""
    from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper

    tok, model = load_tokenizer(tiny), load_model(tiny, torch.device("cpu"))
    rollout = sample_texts(model, tok, ["12+3="], SamplingParams(n=20_000, max_new_tokens=1, temperature=0.8, top_k=3),
                           torch.Generator().manual_seed(0))
    with torch.no_grad():
        ids = tok(["12+3="], return_tensors="pt", add_special_tokens=False).input_ids
        logits = model(input_ids=ids).logits[:, -1, :]
    warped = TopKLogitsWarper(3)(ids, TemperatureLogitsWarper(0.8)(ids, logits))
    probs = torch.softmax(warped, -1)[0]
    hf = torch.multinomial(probs, 20_000, replacement=True, generator=torch.Generator().manual_seed(1))
    vocab = probs.shape[0]
    ours = torch.bincount(rollout.completion_ids[:, 0], minlength=vocab).float() / 20_000
    theirs = torch.bincount(hf, minlength=vocab).float() / 20_000
    assert set(rollout.completion_ids[:, 0].unique().tolist()) <= set(torch.topk(logits[0], 3).indices.tolist())
    assert torch.allclose(ours, probs, atol=0.015) and torch.allclose(ours, theirs, atol=0.02)
