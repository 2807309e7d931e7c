"""Built-in rewards against hand-computed values; the judge model and code execution on real components."""

import math

import pytest
import torch

from components.engine.rewards.rewards import (
    bleu,
    code_execution,
    f1rougebleu,
    judge_model,
    length_penalty,
    overlong_penalty,
    regex_format,
    rouge_l,
    token_f1,
)


def test_token_f1_rouge_l_bleu_by_hand():
    # F1: candidate [the cat sat], reference [the cat sat down]: P = 1, R = 3/4 -> 2 * 0.75 / 1.75 = 6/7
    assert token_f1(["p"], ["The cat sat"], ["the cat sat down"]) == [pytest.approx(6 / 7)]
    # ROUGE-L: LCS([a b c d], [a c d]) = 3 -> P = 3/4, R = 1 -> 6/7
    assert rouge_l(["p"], ["a b c d"], ["a c d"]) == [pytest.approx(6 / 7)]
    # BLEU of [a b c] vs [a b d]: p1 = 2/3, p2 = (1+1)/(2+1) smoothed, p3 = (0+1)/(1+1); equal lengths -> BP = 1
    expected = math.exp((math.log(2 / 3) + math.log(2 / 3) + math.log(1 / 2)) / 3)
    assert bleu(["p"], ["a b c"], ["a b d"]) == [pytest.approx(expected)]
    assert bleu(["p"], ["x y"], ["a b"]) == [0.0]
    assert f1rougebleu(["p"], ["a b c"], ["a b c"]) == [pytest.approx(1.0)]
    assert token_f1(["p"], ["a"], [None]) == [None]


def test_regex_length_and_overlong():
    assert regex_format(["p"] * 3, ["<a>42</a>", "42", " <a>7</a> "], pattern=r"<a>\d+</a>") == [1.0, 0.0, 1.0]
    assert regex_format(["p"], ["so #### 5"], pattern=r"#### \d+", mode="search") == [1.0]
    assert length_penalty(["p"] * 2, ["x" * 10, "x" * 15], max_chars=10) == [0.0, -0.5]
    # DAPO: L_max 6, buffer 2 -> 0 up to 4 tokens, (4 - L) / 2 on (4, 6], -1 beyond
    assert overlong_penalty(["p"] * 4, ["c"] * 4, completion_token_lengths=[4, 5, 6, 7], max_length=6, buffer=2) == \
        [0.0, -0.5, -1.0, -1.0]


def test_code_execution_scores_only_passing_code_and_skips_missing_tests():
    completions = ["def add(a, b):\n    return a + b", "def add(a, b):\n    return a - b", "def add(a, b): pass"]
    tests = ["assert add(2, 3) == 5", "assert add(2, 3) == 5", None]
    assert code_execution(["p"] * 3, completions, tests=tests, timeout_s=5) == [1.0, 0.0, None]


def test_judge_model_scores_with_a_frozen_classifier(tmp_path):
    from transformers import LlamaConfig, LlamaForSequenceClassification

    from components.engine.models.modeling import build_char_tokenizer

    tok = build_char_tokenizer(["abcdefgh 0123456789+="])
    tok.padding_side = "right"
    config = LlamaConfig(vocab_size=len(tok), hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                         intermediate_size=64, num_labels=2, pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    model = LlamaForSequenceClassification(config).eval()
    model.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    scores = judge_model(["1+1=", "2+2="], ["2", "5"], path=str(tmp_path), label_index=1)
    with torch.no_grad():
        enc = tok(["1+1=2", "2+2=5"], return_tensors="pt", padding=True)
        expected = torch.softmax(model(**enc).logits, -1)[:, 1].tolist()
    assert scores == pytest.approx(expected, abs=1e-6) and all(0 < s < 1 for s in scores)
    with pytest.raises(ValueError, match="needs options.path"):
        judge_model(["p"], ["c"])


def test_distinct_ngrams_by_hand():
    """Bigrams within each prompt's group: 'a b c' shares 'a b' with 'a b d' -> 1 of 2 own; a copy scores 0; a
    completion alone with its prompt is not applicable; an empty one scores 0; shorter than n is one n-gram."""
    from components.engine.rewards.rewards import distinct_ngrams

    prompts = ["p", "p", "p", "q", "r", "r", "r"]
    completions = ["a b c", "a b d", "x y", "alone here", "", "same", "same"]
    assert distinct_ngrams(prompts, completions, n=2) == [0.5, 0.5, 1.0, None, 0.0, 0.0, 0.0]
    assert distinct_ngrams(["p", "p"], ["A b", "a B"], n=1) == [0.0, 0.0]  # words, case-insensitive
    assert distinct_ngrams(["p", "p"], ["a b", "c"], n=3) == [1.0, 1.0]


def test_distinct_ngrams_is_a_builtin_and_refuses_a_bad_n():
    from components.config import RewardSpec
    from components.engine.rewards.rewards import RewardError, RewardModel

    model = RewardModel([RewardSpec("distinct_ngrams", 1.0, {"n": 0})])
    with pytest.raises(RewardError, match="distinct_ngrams.*n must be >= 1"):
        model(["p", "p"], ["a", "b"], {})


def test_distinct_ngrams_compares_within_sampled_groups_when_told():
    """Two groups of the same prompt in one step (a prompt drawn twice) stay two groups with `group_index`."""
    from components.engine.rewards.rewards import distinct_ngrams

    prompts, completions = ["p"] * 4, ["a b", "c d", "a b", "e f"]
    assert distinct_ngrams(prompts, completions) == [0.0, 1.0, 0.0, 1.0]
    assert distinct_ngrams(prompts, completions, group_index=[0, 0, 1, 1]) == [1.0, 1.0, 1.0, 1.0]
