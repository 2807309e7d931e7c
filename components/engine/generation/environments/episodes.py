"""How a row plays: its prompt, what answers the model's turns, and the frozen `Episode` it leaves.

Two plays, one contract (`Play`), so the generation loop (service.py) never asks which it runs:
- `SingleTurn`: the record formatted by `prompt.template` (through the chat template where it applies) is the prompt,
  and the row ends after the model's first turn;
- `Episodes`: one environment per row (the user's, or `ToolEnvironment` for `grpo.tools`): `reset(record)` gives
  the first messages, rendered once per group by the chat template; `step(turn)` answers each model turn, until it
  ends the episode or a limit does.

Limits: `max_turns` model turns; the call's token budget (`SamplingParams.max_new_tokens`, the only one: tokens after
the prompt, model and environment together, TRL's `max_completion_length` for tool episodes: an answer that would not
fit is dropped and the episode ends there); a tool or environment call's seconds (`timeout_s`). An episode a limit
ends is cut: the environment is asked for its reward (`on_cut(reason)`, when it has that method), else it scores
`cut_reward`, so it takes part in its group's comparison like any other.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from components.engine.generation.environments.chat import ChatFormat
from components.engine.generation.environments.environment import Environment, EnvironmentStep, as_step
from components.engine.generation.rollouts import Episode, Message, encode_prompts
from components.engine.models.prompting import longest_row
from components.errors import StageFailed
from components.user_code import UserCodeError, calling

LIMITS = ("turns", "tokens")  # the cuts a limit makes (the others are environment errors)
CUT_WORDS = {"tokens": "cut at the token budget (grpo.max_completion_length) before the environment ended them",
             "turns": "cut at grpo.episode.max_turns before the environment ended them"}


class EnvironmentFailed(StageFailed):
    """The environment failed on most episodes of a turn, or cannot start one: the stage stops with this line
    (checkpoints kept)."""


@dataclass(frozen=True, kw_only=True)
class EpisodeLimits:
    """What ends an episode besides its environment (the token budget is the call's: `take_turn`'s `budget`)."""

    max_turns: int = 4
    timeout_s: float = 10.0
    failure_share: float = 0.5  # more than this share of a turn's episodes failing stops the stage
    cut_reward: float = 0.0  # the environment reward of an episode a limit ended, when the environment gives none


@dataclass
class Row:
    """One row while it plays; frozen into an `Episode` when it ends."""

    environment: Any
    ids: list[int] = field(default_factory=list)
    model: list[int] = field(default_factory=list)
    logp: list[float] = field(default_factory=list)
    messages: list[Message] = field(default_factory=list)
    turns: int = 0
    tool_calls: int = 0
    tool_errors: int = 0
    reward: float | None = None
    cut: str | None = None
    done: bool = False
    ended_with_eos: bool = True
    answer: list[int] = field(default_factory=list)  # the answer's ids appended last (the next turn starts after them)

    def freeze(self) -> Episode:
        return Episode(tuple(self.messages), tuple(self.ids), tuple(self.model), tuple(self.logp), self.turns,
                       self.ended_with_eos, self.tool_calls, self.tool_errors, self.reward, self.cut)


class Play(Protocol):
    """What a run's rows are: their prompts and environments, and how the model's turns are answered and read."""

    describe: str  # what failures name
    limits: EpisodeLimits

    def start(self, records: Sequence[dict[str, Any]], n: int) -> tuple[list[list[int]], list[Row]]:
        """Each record's prompt ids and `n` rows per record, prompt-major."""
        ...

    def step(self, row: Row, text: str) -> EnvironmentStep | None:
        """The answer to the model's turn `text`; None when the environment failed (the row's `cut` says how)."""
        ...

    def answer_ids(self, messages: Sequence[Message]) -> list[int]:
        """The tokens of an answer, through the generation prompt of the model's next turn."""
        ...

    def on_cut(self, row: Row) -> float | None:
        """The environment's reward for a row a limit ended (None: it keeps none)."""
        ...

    def columns(self, episodes: Sequence[Episode]) -> dict[str, list[Any]]:
        """What rewards read about the episodes beside their texts."""
        ...

    def transcript(self, episode: Episode) -> str:
        """What a person reads of an episode (sample tables, evaluation outputs)."""
        ...

    def ending(self, episode: Episode) -> str:
        """How an episode ended, in words (what `--dry-run` says of an episode no reward scored)."""
        ...

    def longest_prompt(self, records: Sequence[dict[str, Any]]) -> int:
        ...


class SingleTurn:
    """Rows that end after the model's first turn; the prompt is `format_prompt(record)`, tokenised as one batch."""

    describe = "single turn"

    def __init__(self, tokenizer: Any, format_prompt: Callable[[dict[str, Any]], str], limits: EpisodeLimits):
        self.tokenizer, self.format_prompt, self.limits = tokenizer, format_prompt, limits

    def start(self, records: Sequence[dict[str, Any]], n: int) -> tuple[list[list[int]], list[Row]]:
        prompts = encode_prompts(self.tokenizer, [self.format_prompt(r) for r in records])
        return prompts, [Row(None) for _ in range(len(records) * n)]

    def step(self, row: Row, text: str) -> EnvironmentStep:
        return DONE

    def answer_ids(self, messages: Sequence[Message]) -> list[int]:
        raise RuntimeError("a single turn is never answered")

    def on_cut(self, row: Row) -> float | None:
        return None

    def columns(self, episodes: Sequence[Episode]) -> dict[str, list[Any]]:
        return {}

    def transcript(self, episode: Episode) -> str:
        return episode.answer

    def ending(self, episode: Episode) -> str:
        return "cut at the token budget (grpo.max_completion_length)" if episode.cut else "ended with EOS"

    def longest_prompt(self, records: Sequence[dict[str, Any]]) -> int:
        return longest_row(self.tokenizer, self.format_prompt, records, 0)


DONE = EnvironmentStep(done=True)


class Episodes:
    """Rows that play an environment each (`make_environment()` per row) through `chat`'s template."""

    def __init__(self, chat: ChatFormat, make_environment: Callable[[], Environment], limits: EpisodeLimits,
                 describe: str = "environment"):
        self.chat, self.make_environment, self.limits, self.describe = chat, make_environment, limits, describe

    def start(self, records: Sequence[dict[str, Any]], n: int) -> tuple[list[list[int]], list[Row]]:
        """Each record's prompt: its environments' first messages, which must agree within the group."""
        prompts, rows = [], []
        for record in records:
            group = [self._reset(record) for _ in range(n)]
            if any(messages != group[0][1] for _, messages in group):
                raise EnvironmentFailed(f"{self.describe}: reset gave one record's {n} episodes different first "
                                        f"messages (record {record.get('id')!r}); GRPO compares completions of one "
                                        "prompt")
            prompts.append(self.chat.prompt_ids(group[0][1]))
            rows += [Row(environment) for environment, _ in group]
        return prompts, rows

    def _reset(self, record: dict[str, Any]) -> tuple[Any, list[Message]]:
        try:  # the user's code, through the one door (components/user_code.py)
            with calling(self.describe, "starting an episode", timeout_s=self.limits.timeout_s):
                environment = self.make_environment()
                return environment, environment.reset(record)
        except UserCodeError as err:  # this record cannot be played
            cause = err.__cause__
            raise EnvironmentFailed(f"{self.describe}: reset raised {type(cause).__name__}: {cause} "
                                    f"(record {record.get('id')!r})") from err

    def step(self, row: Row, text: str) -> EnvironmentStep | None:
        try:  # the user's code, through the one door: whatever it raises fails this episode, not the step
            with calling(self.describe, "answering a turn", timeout_s=self.limits.timeout_s):
                return as_step(row.environment.step(text))
        except UserCodeError as err:
            cause = err.__cause__
            row.cut = f"environment error: {type(cause).__name__}: {cause}"
            return None

    def answer_ids(self, messages: Sequence[Message]) -> list[int]:
        return self.chat.answer_ids(messages)

    def on_cut(self, row: Row) -> float | None:
        ask = getattr(row.environment, "on_cut", None)
        if not callable(ask):
            return None
        try:
            with calling(self.describe, "scoring a cut episode", timeout_s=self.limits.timeout_s):
                reward = ask(row.cut)
        except UserCodeError as err:  # its failure leaves the episode unscored, as a failing step does
            row.cut = f"environment error: {type(err.__cause__).__name__}: {err.__cause__}"
            return None
        return None if reward is None else float(reward)

    def columns(self, episodes: Sequence[Episode]) -> dict[str, list[Any]]:
        return {"episode": [list(e.messages) for e in episodes], "environment_reward": [e.reward for e in episodes],
                "tool_calls": [e.tool_calls for e in episodes], "tool_errors": [e.tool_errors for e in episodes],
                "turns": [e.turns for e in episodes]}

    def transcript(self, episode: Episode) -> str:
        return "\n".join(f"[{m['role']}{'/' + str(m['name']) if m.get('name') else ''}] {m['content']}"
                         for m in episode.messages)

    def ending(self, episode: Episode) -> str:
        if episode.cut in CUT_WORDS:
            return CUT_WORDS[episode.cut]
        if episode.cut:
            return f"ended by an {episode.cut.split(':')[0]}"
        return "ended by the environment without a reward of its own"

    def longest_prompt(self, records: Sequence[dict[str, Any]]) -> int:
        return max((len(self.chat.prompt_ids(self._reset(r)[1])) for r in records), default=1)


def take_turn(play: Play, row: Row, ids: list[int], logp: list[float], eos_id: int, decode: Callable[[list[int]], str],
              budget: int) -> None:
    """Append the model's turn to `row` (cut to `budget`, the row's tokens after its prompt); let the environment
    answer, unless the turn was cut off or a limit ends the episode first. The answer's ids are left in `row.answer`."""
    limits = play.limits
    ids = ids[: budget - len(row.ids)]
    row.ids, row.model, row.logp = row.ids + ids, row.model + [1] * len(ids), row.logp + logp[: len(ids)]
    row.turns += 1
    text = decode([t for t in ids if t != eos_id])
    row.messages.append({"role": "assistant", "content": text})
    row.ended_with_eos, row.answer = bool(ids) and ids[-1] == eos_id, []
    if not row.ended_with_eos:  # out of tokens mid-turn: the environment is not asked about half a turn
        row.done, row.cut = True, "tokens"
        return
    step = play.step(row, text)
    if step is None:  # the environment failed on this turn
        row.done = True
        return
    row.tool_calls += step.tool_calls
    row.tool_errors += step.tool_errors
    if step.done or not step.messages:
        row.done, row.reward = True, step.reward
        return
    if row.turns >= limits.max_turns:
        row.done, row.cut = True, "turns"
        return
    answer = play.answer_ids(step.messages)
    if len(row.ids) + len(answer) >= budget:  # no room for the answer and a turn after it
        row.done, row.cut = True, "tokens"
        return
    row.messages += step.messages
    row.ids, row.model, row.logp = row.ids + answer, row.model + [0] * len(answer), row.logp + [0.0] * len(answer)
    row.answer = answer


def finish(play: Play, row: Row) -> Episode:
    """The row's frozen episode; a row a limit cut is scored by its environment (`on_cut`) or `cut_reward`."""
    if row.cut in LIMITS:
        asked = play.on_cut(row)
        if row.cut in LIMITS:  # `on_cut` itself did not fail
            row.reward = play.limits.cut_reward if asked is None else asked
    return row.freeze()


def failed(rows: Sequence[Row]) -> list[str]:
    """Why each of `rows` that the environment failed on ended."""
    return [row.cut for row in rows if row.cut is not None and row.cut not in LIMITS]
