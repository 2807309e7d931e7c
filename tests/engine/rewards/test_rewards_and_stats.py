"""Reward contract and the paired bootstrap."""

from dataclasses import dataclass

import numpy as np
import pytest

from components.engine.evaluation.heldout import paired_bootstrap
from components.engine.rewards.rewards import RewardError, RewardModel, exact_match, numeric_match, resolve_reward


@dataclass
class Spec:
    name: str
    weight: float = 1.0


def test_exact_match_and_none_for_missing_answer():
    assert exact_match(["a"] * 3, ["82", " 82 ", "83"], ["82", "82", "82"]) == [1.0, 1.0, 0.0]
    assert exact_match(["a"], ["82"], [None]) == [None]


def test_numeric_match_tolerance():
    assert numeric_match(["a"] * 3, ["82.0 apples", "x", "81"], ["82", "82", "82"]) == [1.0, 0.0, 0.0]


def test_weighted_sum_and_none_excluded_from_component_mean():
    model = RewardModel([Spec("exact_match", 2.0), Spec("numeric_match", 0.5)])
    result = model(["p"] * 3, ["5", "6", "5"], {"answer": ["5", "5", None]})
    assert result.total == [2.5, 0.0, 0.0]
    assert result.component_means()["exact_match"] == pytest.approx(0.5)  # None (row 3) excluded


def test_user_reward_by_dotted_path():
    fn = resolve_reward("reward_fixtures:starts_with_one")
    assert fn(["p", "p"], ["12", "21"]) == [1.0, 0.0]


@pytest.mark.parametrize("name,message", [
    ("reward_fixtures:raises", "raised RuntimeError: boom"),
    ("reward_fixtures:wrong_length", "returned 1 values for 2 completions"),
    ("reward_fixtures:not_a_number", "returned nan"),
])
def test_misbehaving_reward_is_named(name, message):
    with pytest.raises(RewardError, match=message) as err:
        RewardModel([Spec(name)])(["p", "p"], ["a", "b"], {})
    assert name in str(err.value)


def test_paired_bootstrap_constant_difference_has_degenerate_interval():
    out = paired_bootstrap(np.ones(50), np.zeros(50), 1000, 0)
    assert out == {"mean": 1.0, "ci95_low": 1.0, "ci95_high": 1.0}


def test_paired_bootstrap_interval_matches_normal_approximation():
    rng = np.random.default_rng(0)
    cand, base = rng.integers(0, 2, 2000).astype(float), rng.integers(0, 2, 2000).astype(float)
    out = paired_bootstrap(cand, base, 4000, 1)
    diffs = cand - base
    se = diffs.std(ddof=1) / np.sqrt(len(diffs))
    assert out["mean"] == pytest.approx(diffs.mean())
    assert out["ci95_low"] == pytest.approx(diffs.mean() - 1.96 * se, abs=0.01)
    assert out["ci95_high"] == pytest.approx(diffs.mean() + 1.96 * se, abs=0.01)
