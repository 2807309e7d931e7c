"""Reward functions imported by tests through `module:function` names, as users' own rewards are."""


def starts_with_one(prompts, completions, **_):
    """1.0 when the completion starts with the digit 1: a reward a random tiny model can learn fast."""
    return [1.0 if c.startswith("1") else 0.0 for c in completions]


def raises(prompts, completions, **_):
    raise RuntimeError("boom")


def wrong_length(prompts, completions, **_):
    return [0.0]


def not_a_number(prompts, completions, **_):
    return [float("nan")] * len(completions)


_CALLS = {"flaky": 0}


def flaky_twice(prompts, completions, **_):
    """Raises on its first two calls, then scores like starts_with_one: a transient failure."""
    _CALLS["flaky"] += 1
    if _CALLS["flaky"] <= 2:
        raise ConnectionError("judge service unavailable")
    return starts_with_one(prompts, completions)


def slow(prompts, completions, **_):
    import time

    time.sleep(30)
    return [0.0] * len(completions)


def first_digit_or_none(prompts, completions, **_):
    """A graded reward (the completion's first digit / 9) that scores nothing (None) when it has no digit:
    exercises unscored completions in a real training step."""
    out = []
    for completion in completions:
        digits = [ch for ch in completion if ch.isdigit()]
        out.append(int(digits[0]) / 9 if digits else None)
    return out


def always_one(prompts, completions, **_):
    return [1.0] * len(completions)


def always_zero(prompts, completions, **_):
    return [0.0] * len(completions)


def every_other(prompts, completions, **_):
    """1, 0, 1, 0, ... over the completions: with n samples per prompt (n even), n/2 of each prompt's are correct."""
    return [float(i % 2 == 0) for i in range(len(completions))]


def pays_for_length(prompts, completions, **_):
    """A hackable reward: pays for characters, whatever they say."""
    return [len(c) / 10 for c in completions]


def starts_with_digit(prompts, completions, digit=None, **_):
    """1.0 when the completion starts with the row's `digit` column (1 where the data has no such column): a
    held-out split that asks for another digit than training does cannot improve while training learns."""
    wanted = digit or ["1"] * len(completions)
    return [1.0 if c.startswith(str(d or "1")) else 0.0 for c, d in zip(completions, wanted)]


def starts_with_one_slowly(prompts, completions, **_):
    """starts_with_one after 0.25 s, as a remote judge would take: a run long enough to lose and regain a server."""
    import time

    time.sleep(0.25)
    return starts_with_one(prompts, completions)


def starts_with_one_until_released(prompts, completions, **_):
    """starts_with_one after 0.1 s that, from its 30th call on, waits while the file named by GRPO_TEST_HOLD exists
    (at most 300 s): a test makes something happen mid-run (a server lost and back) before the run can end, on any
    machine speed."""
    import os
    import time

    _CALLS["held"] = _CALLS.get("held", 0) + 1
    hold, deadline = os.environ.get("GRPO_TEST_HOLD"), time.monotonic() + 300
    while _CALLS["held"] >= 30 and hold and os.path.exists(hold) and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.1)
    return starts_with_one(prompts, completions)


def exits(prompts, completions, **_):
    """Leaves by another door than an exception: `sys.exit(1)` (SystemExit)."""
    import sys

    sys.exit(1)


def interrupts(prompts, completions, **_):
    """Raises KeyboardInterrupt itself (no signal came): the reward's failure, not a Ctrl-C."""
    raise KeyboardInterrupt


def runs_out_of_memory(prompts, completions, **_):
    raise MemoryError("cannot allocate the judge's batch")


def ends_the_process(prompts, completions, **_):
    """`os._exit(3)`, as a C extension that aborts or exits would: no exception, no `finally`."""
    import os

    os._exit(3)


def is_killed(prompts, completions, **_):
    """The process is killed while this reward scores (the out-of-memory killer's SIGKILL)."""
    import os
    import signal

    os.kill(os.getpid(), signal.SIGKILL)


def abstains(prompts, completions, **_):
    """Scores nothing: None (not applicable) for every completion, as a reward that does not apply to a task does."""
    return [None] * len(completions)
