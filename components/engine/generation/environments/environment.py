"""An environment answers the model's turns: `reset(record)` gives an episode's first messages, `step(turn)` answers
a model turn with messages, or ends the episode (with its own reward, if it keeps one). One instance per rollout.

`grpo.environment: package.module:factory` names the factory (called with no arguments). `ToolEnvironment` is the
one the pipeline builds from `grpo.tools`: it answers tool calls with their results and ends the episode at the
first turn that calls none (the model's answer)."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from components.config import ConfigError
from components.engine.generation.environments.calls import MALFORMED, parse_tool_calls
from components.engine.generation.environments.tools import Tool, ToolResult, call_tool
from components.user_code import load_callable


@dataclass(frozen=True)
class EnvironmentStep:
    """An environment's answer to one model turn."""

    messages: list[dict[str, Any]] = field(default_factory=list)  # what the model reads next (none when done)
    done: bool = False
    reward: float | None = None  # the episode's reward, when the environment scores it
    tool_calls: int = 0  # calls the turn made (counted in the episode's statistics)
    tool_errors: int = 0  # of which failed: raised, timed out, returned no text, or could not be read


class Environment(Protocol):
    def reset(self, record: dict[str, Any]) -> list[dict[str, Any]]: ...

    def step(self, turn: str) -> EnvironmentStep | Mapping[str, Any]: ...


def as_step(answer: EnvironmentStep | Mapping[str, Any]) -> EnvironmentStep:
    """A user environment's answer as a step: an `EnvironmentStep`, or a mapping with the same keys."""
    if isinstance(answer, EnvironmentStep):
        return answer
    if isinstance(answer, Mapping):
        unknown = set(answer) - {"messages", "done", "reward", "tool_calls", "tool_errors"}
        if unknown:
            raise TypeError(f"step returned unknown keys {sorted(unknown)}")
        return EnvironmentStep(list(answer.get("messages") or []), bool(answer.get("done", False)),
                               answer.get("reward"), int(answer.get("tool_calls", 0)),
                               int(answer.get("tool_errors", 0)))
    raise TypeError(f"step returned {type(answer).__name__}, not messages and done")


class ToolEnvironment:
    """Tools as an environment: each call in a turn is run (`tools.call_tool`) and its result is a `tool` message;
    a turn that calls no tool is the answer and ends the episode."""

    def __init__(self, tools: Sequence[Tool], first_messages: Callable[[dict[str, Any]], list[dict[str, Any]]],
                 timeout_s: float, tokenizer: Any = None):
        self.tools = {t.name: t for t in tools}
        self.first_messages, self.timeout_s, self.tokenizer = first_messages, timeout_s, tokenizer

    def reset(self, record: dict[str, Any]) -> list[dict[str, Any]]:
        return self.first_messages(record)

    def step(self, turn: str) -> EnvironmentStep:
        parsed = parse_tool_calls(turn, self.tokenizer)
        if not parsed.wants_tools:
            return EnvironmentStep(done=True)
        results: list[ToolResult] = [call_tool(self.tools, call, self.timeout_s) for call in parsed.calls]
        if parsed.malformed is not None:
            results.append(ToolResult("tool", MALFORMED.format(reason=parsed.malformed), True))
        return EnvironmentStep([{"role": "tool", "name": r.name, "content": r.text} for r in results],
                               tool_calls=len(results), tool_errors=sum(r.error for r in results))


def load_environment_factory(name: str) -> Callable[[], Environment]:
    """`grpo.environment` -> its factory; one that cannot be imported, or whose instances lack `reset` and `step`,
    is refused before training with one line naming it."""
    try:
        factory = load_callable(name, {}, "environment")
    except (KeyError, ImportError, AttributeError) as err:
        raise ConfigError(f"grpo.environment: {err.args[0] if err.args else err}") from err
    try:
        instance = factory()
    except Exception as err:
        raise ConfigError(f"grpo.environment: {name!r} raised {type(err).__name__} when built: {err}") from err
    missing = [m for m in ("reset", "step") if not callable(getattr(instance, m, None))]
    if missing:
        raise ConfigError(f"grpo.environment: {name!r} builds {type(instance).__name__}, which has no "
                          f"{' and no '.join(missing)} method")
    return factory
