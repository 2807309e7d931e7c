"""Tools and environments a test points `grpo.tools` / `grpo.environment` at (importable by module path)."""

from __future__ import annotations

import time


def add(a: int, b: int) -> str:
    """Add two integers.

    Args:
        a: the first.
        b: the second.
    """
    return str(a + b)


def boom(x: str) -> str:
    """Always fails.

    Args:
        x: anything.
    """
    raise RuntimeError("tool exploded")


def exits(x: str) -> str:
    """Leaves by another door.

    Args:
        x: anything.
    """
    raise SystemExit(3)


def sleepy(seconds: float) -> str:
    """Sleeps.

    Args:
        seconds: how long.
    """
    time.sleep(seconds)
    return "woke"


def not_text(x: str) -> object:
    """Returns no text.

    Args:
        x: anything.
    """
    return {"x": x}


def untyped(x):
    """No type hint."""
    return x


class Echo:
    """Answers each turn with its text in capitals until it sees "bye"; rewards 1 for saying "bye" by turn 2."""

    def reset(self, record):
        self.turns = 0
        return [{"role": "user", "content": f"say bye to {record['prompt']}"}]

    def step(self, turn):
        self.turns += 1
        if "bye" in turn:
            return {"done": True, "reward": 1.0 if self.turns <= 2 else 0.5}
        return {"messages": [{"role": "user", "content": turn.upper() or "SAY SOMETHING"}], "done": False}


class Broken:
    def reset(self, record):
        return [{"role": "user", "content": "hi"}]

    def step(self, turn):
        raise ValueError("the environment broke")


class Quitter(Broken):
    def step(self, turn):
        raise SystemExit("the environment quit")


def quitter():
    return Quitter()


def echo():
    return Echo()


def broken():
    return Broken()


def no_step():
    return object()


class GuessNumber:
    """Guess a number from 1 to 9 (7): reward 1 on a hit, 0 after three misses; "higher"/"lower" between."""

    def reset(self, record):
        self.misses = 0
        return [{"role": "user", "content": "Guess my number from 1 to 9."}]

    def step(self, turn):
        if "7" in turn:
            return {"done": True, "reward": 1.0}
        self.misses += 1
        if self.misses >= 3:
            return {"done": True, "reward": 0.0}
        return {"messages": [{"role": "user", "content": "higher" if turn.strip() < "7" else "lower"}]}


class GuessNumberScoringCuts(GuessNumber):
    """Asked for its reward when a limit ends the episode: a little for the misses it saw."""

    def on_cut(self, reason):
        return -0.5 if reason == "tokens" else -0.25


def guess_number():
    return GuessNumber()


def guess_number_scoring_cuts():
    return GuessNumberScoringCuts()
