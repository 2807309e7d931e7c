"""Reward-hacking monitors and the not-learning diagnosis on step histories with known answers."""

from __future__ import annotations

import pytest

from components.config import MonitorsConfig, MonitorSpec, NoSignalConfig, NotLearningConfig
from components.engine.evaluation.monitors import (
    Monitors,
    generalisation,
    generalisation_text,
    no_signal,
    not_learning,
    signal_values,
)


def steps(n: int, **columns) -> list[dict]:
    """n history rows; each column a constant or a function of the 0-based step index."""
    return [{"step": i + 1, **{k: (v(i) if callable(v) else v) for k, v in columns.items()}} for i in range(n)]


def test_window_signals_are_means_over_the_last_window():
    history = steps(10, kl=lambda i: float(i), completion_length=lambda i: 2.0 if i < 5 else 3.0, reward_mean=0.5)
    values = signal_values(history, 10, window=5, evaluations=3, keep_metric="reward")
    assert values["kl"] == pytest.approx((5 + 6 + 7 + 8 + 9) / 5)
    assert values["completion_length_growth"] == pytest.approx(3.0 / 2.0 - 1)  # last window over step 1
    assert signal_values(history, 4, window=5, evaluations=3, keep_metric="reward") == {}  # window not full yet


def test_a_breach_is_recorded_once_with_its_first_step_and_value():
    m = MonitorsConfig(window=2, checks=[MonitorSpec("kl", above=1.0, action="block"),
                                         MonitorSpec("entropy", below=0.1, action="warn")])
    history = steps(6, kl=lambda i: [0.5, 0.5, 0.9, 1.5, 2.0, 0.1][i], entropy=1.0)
    monitors = Monitors(m, "reward")
    firsts = [monitors.check(history, end) for end in range(1, 7)]
    # window of 2: means 0.5, 0.7, 1.2 (step 4: first above 1.0), 1.75, 1.05
    assert [len(f) for f in firsts] == [0, 0, 0, 1, 0, 0]
    breach = firsts[3][0]
    assert (breach.signal, breach.step, breach.action) == ("kl", 4, "block")
    assert breach.value == pytest.approx(1.2)
    summary = monitors.summary()
    assert summary[0]["breached"] and summary[0]["breach"]["step"] == 4
    assert not summary[1]["breached"] and summary[1]["last_value"] == 1.0


def test_heldout_drop_counts_only_while_the_training_reward_rises():
    def history(train):
        rows = steps(8, reward_mean=train)
        for step, value in ((2, 0.8), (4, 0.7), (6, 0.6), (8, 0.5)):
            rows[step - 1]["heldout/reward"] = value
        return rows

    rising = signal_values(history(lambda i: 0.1 * i), 8, window=2, evaluations=3, keep_metric="reward")
    assert rising["heldout_drop"] == pytest.approx(0.8 - 0.5)  # three evaluations back: step 2
    assert rising["reward_heldout_gap"] == pytest.approx((0.6 + 0.7) / 2 - 0.5)
    # Monitors track the evaluated steps as they come: the same value, with and without a replay.
    monitors = Monitors(MonitorsConfig(window=2, evaluations=3, checks=[MonitorSpec("heldout_drop", above=0.2)]),
                        "reward")
    monitors.replay(history(lambda i: 0.1 * i))
    assert monitors.last["heldout_drop"] == pytest.approx(0.3) and monitors.breaches[0].step == 8
    falling = signal_values(history(lambda i: 1 - 0.1 * i), 8, window=2, evaluations=3, keep_metric="reward")
    assert falling["heldout_drop"] == 0.0  # both fell: not the mark of a hacked reward


def _flat_history(train, gains: dict[int, tuple[float, float]]) -> list[dict]:
    """20 steps of training reward `train(i)`, held-out evaluations {step: (change over the start, its se)}."""
    rows = steps(20, reward_mean=train)
    for step, (gain, se) in gains.items():
        rows[step - 1].update({"heldout/reward": 0.5 + gain, "heldout/reward_vs_start": gain,
                               "heldout/reward_vs_start_se": se})
    return rows


def test_heldout_flat_is_the_training_gain_when_the_heldout_change_is_within_its_noise():
    train = lambda i: 0.2 + 0.02 * i  # noqa: E731 - 0.20, 0.22, ... 0.58
    flat = _flat_history(train, {10: (0.03, 0.02), 20: (0.03, 0.02)})
    # w = min(window 50, 20 // 4) = 5: last five (0.50..0.58, mean 0.54) minus first five (0.20..0.28, mean 0.24)
    run = generalisation(flat, 20, window=50, keep_metric="reward", evals=[9, 19])
    assert run == {"step": 20, "metric": "reward", "train_gain": pytest.approx(0.30), "heldout_gain": 0.03,
                   "heldout_noise": pytest.approx(1.96 * 0.02), "heldout_rose": False}  # 0.03 <= 0.0392
    assert generalisation_text(run, 0.1) == ("training reward +0.300, held-out reward +0.030 (noise ±0.039) over the "
                                             "start: learning that does not generalise")
    values = signal_values(flat, 20, window=50, evaluations=3, keep_metric="reward", evals=[9, 19], final=True)
    assert values == {"heldout_flat": pytest.approx(0.30)}  # the window signals need 50 steps: only this one
    assert signal_values(flat, 20, window=50, evaluations=3, keep_metric="reward", evals=[9, 19]) == {}  # not final
    rose = _flat_history(train, {10: (0.03, 0.02), 20: (0.05, 0.02)})  # 0.05 > 0.0392: above its noise
    assert signal_values(rose, 20, 50, 3, "reward", [9, 19], final=True) == {"heldout_flat": 0.0}
    assert generalisation_text(generalisation(rose, 20, 50, "reward", [9, 19]), 0.1).endswith(": held-out rose")
    still = _flat_history(lambda i: 0.3, {20: (0.0, 0.02)})
    assert generalisation_text(generalisation(still, 20, 50, "reward", [19]), 0.1).endswith(": neither rose")
    # Monitors judge it at the run's last step only, with the threshold as the action's line.
    monitors = Monitors(MonitorsConfig(window=50, checks=[MonitorSpec("heldout_flat", above=0.1, action="warn")]),
                        "reward", steps=20)
    breaches = [monitors.check(flat, end) for end in range(1, 21)]
    assert [len(b) for b in breaches] == [0] * 19 + [1] and breaches[-1][0].value == pytest.approx(0.30)


def test_replay_after_resume_reaches_the_same_breaches():
    m = MonitorsConfig(window=3, checks=[MonitorSpec("completion_length_growth", above=0.5)])
    history = steps(12, completion_length=lambda i: 2.0 + 0.3 * i)
    live = Monitors(m, "reward")
    for end in range(1, 13):
        live.check(history, end)
    replayed = Monitors(m, "reward")
    replayed.replay(history)
    assert replayed.summary() == live.summary() and live.summary()[0]["breached"]


def test_not_learning_says_why_and_stays_quiet_while_learning():
    c = NotLearningConfig(window=10, min_reward_gain=0.05, zero_variance_above=0.5)
    flat = steps(20, reward_mean=0.08, all_fail_group_frac=0.7)
    message = not_learning(flat, c)
    assert "0.080 -> 0.080" in message and "70% of groups score zero" in message
    assert "dynamic sampling" in message and "warm start" in message and "learning_rate" in message
    assert not_learning(flat[:19], c) is None  # too early: needs two windows
    learning = steps(20, reward_mean=lambda i: 0.05 + 0.01 * i, all_fail_group_frac=0.7)
    assert not_learning(learning, c) is None  # starving at first, but the reward climbs
    solved = steps(20, reward_mean=lambda i: 0.9, all_fail_group_frac=0.0)
    assert "score zero" not in not_learning(solved, c)  # flat because all right: not blamed on starving


def test_no_signal_is_judged_once_on_the_first_steps():
    c = NoSignalConfig(steps=10, zero_variance_above=0.9)
    starved = steps(12, zero_std_group_frac=lambda i: 0.875 if i == 0 else 1.0, all_fail_group_frac=0.9,
                    truncated_frac=0.5)
    said = [no_signal(starved[:end], c, 40, 16) for end in range(1, 13)]
    assert [s is not None for s in said] == [False] * 9 + [True, False, False]  # at step 10 only
    # (0.875 + 9 * 1.0) / 10 = 0.9875 of groups alike; 0.9 of them all zero
    assert said[9].startswith("no signal: 99% of groups in the first 10 steps scored every completion alike (90% all "
                              "zero, 9% all the same above zero), so they give GRPO no gradient. Likely causes: the "
                              "reward's answer extraction")
    assert "grpo.max_completion_length 16: 50% of completions were cut off" in said[9]
    healthy = steps(10, zero_std_group_frac=0.7, all_fail_group_frac=0.6)  # the default's first steps: ~70%
    assert no_signal(healthy, c, 40, 16) is None
    assert no_signal(starved[:6], c, 6, 16) is not None  # a 6-step run is judged at its last step
    assert no_signal(starved[:10], NoSignalConfig(steps=0), 40, 16) is None  # off
    solved = steps(10, zero_std_group_frac=1.0, all_fail_group_frac=0.0)
    assert no_signal(solved, c, 40, 16).endswith(
        "already solves most prompts alike: harder prompts or a stricter reward")


def test_the_on_policy_check_keeps_its_float32_threshold_out_of_bfloat16_runs():
    import torch

    from components.config import MonitorsConfig, MonitorSpec
    from components.engine.evaluation.monitors import for_dtype

    default = MonitorsConfig()
    assert for_dtype(default, torch.float32) == (default, None)
    kept, said = for_dtype(default, torch.bfloat16)
    assert "logprob_gap" not in [c.signal for c in kept.checks] and "bfloat16" in said
    assert len(kept.checks) == len(default.checks) - 1
    own = MonitorsConfig(checks=[MonitorSpec("logprob_gap", above=0.05, action="warn")])
    assert for_dtype(own, torch.bfloat16) == (own, None)  # a threshold the user set stays
