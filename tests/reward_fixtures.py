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
