"""Task metrics on held-out completions: pass@k against hand-computed cases, and each metric on a real model."""

from __future__ import annotations

import pytest

from components.config import EvaluateConfig, RewardSpec
from components.engine.evaluation.task_metrics import TaskMetrics, metric_key, pass_at_k
from components.engine.generation.engines.base import SamplingParams
from tests.engine.sampling import sample_texts


@pytest.mark.parametrize("n, correct, k, expected", [
    (4, 1, 2, 0.5),        # 1 - C(3,2)/C(4,2) = 1 - 3/6
    (5, 2, 3, 0.9),        # 1 - C(3,3)/C(5,3) = 1 - 1/10
    (4, 2, 2, 5 / 6),      # 1 - C(2,2)/C(4,2) = 1 - 1/6
    (4, 0, 4, 0.0),
    (4, 1, 4, 1.0),        # all four drawn: the correct one is among them
    (10, 3, 1, 0.3),       # pass@1 = c / n
])
def test_pass_at_k_hand_computed(n, correct, k, expected):
    assert pass_at_k(n, correct, k) == pytest.approx(expected)


def test_pass_at_k_refuses_impossible_counts():
    with pytest.raises(ValueError, match="k <= n"):
        pass_at_k(2, 1, 3)


def test_metric_keys_are_valid_mlflow_names():
    assert metric_key("pass@4") == "pass_at_4"
    assert metric_key("my.rewards:score") == "my.rewards.score"


@pytest.fixture(scope="module")
def tiny():
    from components.config import TinyModelConfig
    from components.engine.models.modeling import build_char_tokenizer, build_tiny_model

    tokenizer = build_char_tokenizer(["0123456789+="])
    return build_tiny_model(TinyModelConfig(), tokenizer, seed=0).eval(), tokenizer


def test_every_metric_per_prompt_on_a_real_model(tiny):
    model, tokenizer = tiny
    records = [{"id": i, "prompt": f"{i}+{i}=", "answer": str(2 * i)} for i in range(6)]
    prompts = [r["prompt"] for r in records]
    e = EvaluateConfig(max_new_tokens=5, batch_size=4, pass_k_samples=4, correct_at=1.0,
                       metrics=["reward_fixtures:every_other", "pass@2", "pass@4", "completion_length", "eos_rate",
                                "episode_length", "environment_tokens"])
    values, out = TaskMetrics(e, [RewardSpec("reward_fixtures:every_other")]).per_prompt(model, tokenizer, records,
                                                                                         seed=3)
    greedy = sample_texts(model, tokenizer, prompts, SamplingParams(max_new_tokens=5, greedy=True))
    assert values["completion_length"] == greedy.completion_mask.sum(-1).float().tolist()
    assert values["eos_rate"] == (~greedy.truncated).float().tolist()
    # single turns: every token after the prompt is the model's
    assert values["episode_length"] == values["completion_length"] and values["environment_tokens"] == [0.0] * 6
    # every_other scores the greedy completions 1, 0, 1, ... ; the 4 samples of each prompt 1, 0, 1, 0:
    # two of four correct, so pass@2 = 1 - C(2,2)/C(4,2) = 5/6 and pass@4 = 1 on every prompt.
    assert values["reward"] == values["reward_fixtures:every_other"] == [1.0, 0.0] * 3
    assert values["pass@2"] == pytest.approx([5 / 6] * 6)
    assert values["pass@4"] == [1.0] * 6
    assert list(values) == ["reward", "reward_fixtures:every_other", "pass@2", "pass@4", "completion_length",
                            "eos_rate", "episode_length", "environment_tokens"]
    assert out.lengths == values["completion_length"] and len(out.texts) == 6
