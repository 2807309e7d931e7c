"""Tokenizer, tiny model, and the KV-cached group sampler against a plain full forward."""

import pytest
import torch

from components.config import TinyModelConfig
from components.engine.models.modeling import (
    ModelLoadError,
    build_char_tokenizer,
    build_tiny_model,
    count_parameters,
    load_model,
    load_tokenizer,
    resolve_model_dir,
    save_model,
    seed_everything,
)
from components.engine.models.rollout import completion_logprobs, decode_completions, sample_from, sample_groups

TEXTS = ["12+34=", "46", "99+1=", "100", "7+8=", "15"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    tok = build_char_tokenizer(TEXTS)
    model = build_tiny_model(TinyModelConfig(), tok, seed=0)
    out = tmp_path_factory.mktemp("tiny")
    save_model(model, tok, out)
    return out


def test_char_tokenizer_roundtrips_and_pads_left(tiny):
    tok = load_tokenizer(tiny)
    ids = tok("12+34=", add_special_tokens=False).input_ids
    assert len(ids) == 6 and tok.decode(ids) == "12+34="
    assert len(tok) == 4 + len(set("".join(TEXTS)))
    batch = tok(["1+1=", "12+34="], padding=True, add_special_tokens=False)
    assert batch.attention_mask[0][:2] == [0, 0]  # left padding


def test_tiny_model_size_in_range(tiny):
    n = count_parameters(load_model(tiny, torch.device("cpu")))
    assert 500_000 <= n <= 3_000_000


def test_sampled_completions_logprobs_match_unpadded_forward(tiny):
    tok, model = load_tokenizer(tiny), load_model(tiny, torch.device("cpu"))
    rollout = sample_groups(model, tok, ["1+1=", "12+34=", "99+1="], 4, 5,
                            generator=torch.Generator().manual_seed(0))
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
    one = decode_completions(tok, sample_groups(model, tok, prompts, 1, 5, greedy=True))
    four = decode_completions(tok, sample_groups(model, tok, prompts, 4, 5, greedy=True))
    assert four == [c for c in one for _ in range(4)]


def test_greedy_matches_transformers_generate(tiny):
    tok, model = load_tokenizer(tiny), load_model(tiny, torch.device("cpu"))
    prompts = ["1+1=", "12+34=", "99+1=", "7+8="]
    ours = decode_completions(tok, sample_groups(model, tok, prompts, 1, 5, greedy=True))
    enc = tok(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
    out = model.generate(**enc, max_new_tokens=5, do_sample=False, pad_token_id=tok.pad_token_id,
                         eos_token_id=tok.eos_token_id)
    theirs = [tok.decode(row[: list(row).index(tok.eos_token_id)] if tok.eos_token_id in row else row,
                         skip_special_tokens=True) for row in out[:, enc.input_ids.shape[1]:].tolist()]
    assert ours == theirs


def test_completion_mask_stops_after_eos(tiny):
    tok, model = load_tokenizer(tiny), load_model(tiny, torch.device("cpu"))
    rollout = sample_groups(model, tok, ["1+1="] * 8, 4, 6, generator=torch.Generator().manual_seed(3))
    for ids, mask, truncated in zip(rollout.completion_ids.tolist(), rollout.completion_mask.tolist(),
                                    rollout.truncated.tolist()):
        if tok.eos_token_id in ids:
            k = ids.index(tok.eos_token_id)
            assert mask == [1] * (k + 1) + [0] * (len(ids) - k - 1) and not truncated
        else:
            assert all(mask) and truncated


def test_seed_everything_keeps_deterministic_kernels_without_filling_empty_tensors():
    """Deterministic algorithms stay on (the two-clone reproducibility test relies on them); the NaN fill of
    `torch.empty`, a debugging guard that cost ~1 ms of a tiny-default step, is off."""
    before = torch.are_deterministic_algorithms_enabled(), torch.utils.deterministic.fill_uninitialized_memory
    torch.use_deterministic_algorithms(False)
    torch.utils.deterministic.fill_uninitialized_memory = True
    try:
        seed_everything(0)
        assert torch.are_deterministic_algorithms_enabled()
        assert not torch.utils.deterministic.fill_uninitialized_memory
    finally:
        torch.use_deterministic_algorithms(before[0], warn_only=True)
        torch.utils.deterministic.fill_uninitialized_memory = before[1]


def test_pickle_weights_are_refused(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    torch.save({"w": torch.zeros(1)}, tmp_path / "pytorch_model.bin")
    with pytest.raises(ModelLoadError, match="pickle files; only safetensors"):
        resolve_model_dir(tmp_path)


def test_missing_model_path_mentions_offline_download(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelLoadError, match="download it first"):
        resolve_model_dir("Qwen/Qwen2.5-0.5B-Instruct")


def test_hub_id_is_used_only_when_allowed_and_online(tmp_path, monkeypatch):
    from components.engine.models.modeling import check_model_source, hub_download_allowed, write_pointer

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert not hub_download_allowed("Qwen/Qwen2.5-0.5B-Instruct", allow_download=True)
    with pytest.raises(ModelLoadError, match="model.allow_download: true and HF_HUB_OFFLINE=0"):
        check_model_source("Qwen/Qwen2.5-0.5B-Instruct", allow_download=True)
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    with pytest.raises(ModelLoadError, match="does not exist"):
        check_model_source("Qwen/Qwen2.5-0.5B-Instruct", allow_download=False)
    check_model_source("Qwen/Qwen2.5-0.5B-Instruct", allow_download=True)  # allowed: no error, nothing fetched yet
    write_pointer(tmp_path / "base", "Qwen/Qwen2.5-0.5B-Instruct", hub=True)
    assert str(resolve_model_dir(tmp_path / "base")) == "Qwen/Qwen2.5-0.5B-Instruct"


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

    from components.engine.models.rollout import _filter_top_k, _filter_top_p

    gen = torch.Generator().manual_seed(4)
    logits = torch.randn(6, 12, generator=gen)
    logits[0, 3] = logits[0, 7] = logits[0].max() + 1.0  # a tie at the top
    ours = _filter_top_k(logits, top_k)
    theirs = logits.clone()
    if top_k:
        theirs = TopKLogitsWarper(top_k)(None, theirs)
    if top_p < 1.0:
        ours, theirs = _filter_top_p(ours, top_p), TopPLogitsWarper(top_p)(None, theirs)
    assert torch.equal(torch.isinf(ours), torch.isinf(theirs))
    kept = (~torch.isinf(ours)).sum(-1)
    assert (kept <= max(top_k, 2) if top_k else kept < 12).all() and (kept >= 1).all()


def test_top_k_sampling_draws_what_hugging_face_sampling_draws(tiny):
    """20,000 first tokens sampled with top-k 3 at temperature 0.8: the same frequencies as multinomial draws from
    Hugging Face's warped distribution, and never a token outside the top 3."""
    from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper

    tok, model = load_tokenizer(tiny), load_model(tiny, torch.device("cpu"))
    rollout = sample_groups(model, tok, ["12+3="], 20_000, 1, temperature=0.8, top_k=3,
                            generator=torch.Generator().manual_seed(0))
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


def test_distinct_fraction_counts_rows_that_differ_in_prompt_or_in_completion_up_to_eos():
    from components.engine.models.rollout import Rollout

    prompts = torch.tensor([[0, 5], [0, 5], [0, 5], [7, 6]])
    prompt_mask = torch.tensor([[0, 1], [0, 1], [0, 1], [1, 1]])
    # rows 0 and 1 equal up to EOS (2) and differ only in padding after it; row 2 another answer; row 3 another prompt
    completions = torch.tensor([[3, 2, 0], [3, 2, 9], [4, 2, 0], [3, 2, 0]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 0], [1, 1, 0], [1, 1, 0]])
    rollout = Rollout(prompts, prompt_mask, completions, mask, torch.zeros(4, dtype=torch.bool))
    assert rollout.distinct_fraction() == 3 / 4
    assert rollout.select([0, 2, 3]).distinct_fraction() == 1.0
