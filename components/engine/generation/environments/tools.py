"""Tools the model may call: plain Python functions, their JSON schemas (from the signature and docstring, as TRL
builds them) and one guarded call each, whose result or failure becomes the text the model reads next."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from components.config import ConfigError
from components.engine.generation.environments import builtin
from components.engine.generation.environments.calls import ToolCall
from components.engine.generation.environments.chat import tools_text
from components.user_code import UserCodeError, calling, load_callable

BUILTIN_TOOLS: dict[str, Callable[..., Any]] = {"calculator": builtin.calculator}


@dataclass(frozen=True)
class Tool:
    """A function the model may call, and the schema it is shown."""

    name: str
    function: Callable[..., Any]
    schema: dict[str, Any]  # {"type": "function", "function": {"name", "description", "parameters"}}


@dataclass(frozen=True)
class ToolResult:
    """What the model reads back, and whether the call failed (counted as a tool error)."""

    name: str
    text: str
    error: bool = False


def tool_of(name: str, function: Callable[..., Any]) -> Tool:
    """The tool and its schema; a function whose parameters lack type hints, or whose docstring does not describe
    them, is refused in one line naming it (the model would be shown a tool it cannot call right)."""
    from transformers.utils import get_json_schema

    try:
        schema = get_json_schema(function)
    except Exception as err:
        raise ConfigError(f"grpo.tools: {name!r} cannot be shown to the model: {err} (every parameter needs a type "
                          "hint and a line under 'Args:' in the docstring)") from err
    return Tool(schema["function"]["name"], function, schema)


def load_tools(names: Sequence[str]) -> list[Tool]:
    """`grpo.tools` -> tools, refused before training with one line naming the one that cannot be used."""
    tools = []
    for i, name in enumerate(names):
        try:
            function = load_callable(name, BUILTIN_TOOLS, "tool")
        except (KeyError, ImportError, AttributeError) as err:
            raise ConfigError(f"grpo.tools[{i}]: {err.args[0] if err.args else err}") from err
        tools.append(tool_of(name, function))
    seen = [t.name for t in tools]
    if len(set(seen)) != len(seen):
        raise ConfigError(f"grpo.tools: two tools share a name ({seen}): the model could not tell them apart")
    return tools


def call_tool(tools: Mapping[str, Tool], call: ToolCall, timeout_s: float) -> ToolResult:
    """Run one call: an unknown tool, arguments that do not fit its signature, an exception (`SystemExit` and
    `KeyboardInterrupt` included: the call goes through components/user_code.py), a call past `timeout_s` or a
    result that is not text (nor a number) become an error message the model reads, as TRL does; never a crashed
    step. A stop signal (Ctrl-C, SIGTERM) that arrives during the call stops the stage as usual."""
    tool = tools.get(call.name)
    if tool is None:
        return ToolResult(call.name, f"error: no tool named {call.name!r}; tools: {', '.join(sorted(tools))}", True)
    try:
        inspect.signature(tool.function).bind(**call.arguments)
    except TypeError as err:
        return ToolResult(call.name, f"error: wrong arguments for {call.name}: {err}", True)
    try:  # the one door for user code: SystemExit and KeyboardInterrupt included; a stop signal goes on
        with calling(f"tool {call.name!r}", "answering a call", timeout_s=timeout_s):
            result = tool.function(**call.arguments)
    except UserCodeError as err:  # the user's tool: its failure is the model's to read
        cause = err.__cause__
        return ToolResult(call.name, f"error: {type(cause).__name__}: {cause}", True)
    if isinstance(result, bool) or not isinstance(result, (str, int, float)):
        return ToolResult(call.name, f"error: tool {call.name} returned {type(result).__name__}, not text", True)
    return ToolResult(call.name, str(result))


def tools_prompt(tools: Sequence[Tool]) -> str:
    """How tools are offered to a model whose chat template has no tool format of its own (the plain-text format
    `calls.parse_tool_calls` reads)."""
    return tools_text([t.schema for t in tools])
