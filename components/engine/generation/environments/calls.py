"""Reading the tool calls out of a model turn.

A tokenizer that carries a response parser for its chat template (transformers' `parse_response`, set with a
`response_schema` or `response_template`) reads its own format. Otherwise the plain-text format, which is also what
Hermes-style templates (Qwen2.5, Qwen3, ...) render: one `<tool_call>{"name": NAME, "arguments": {...}}</tool_call>`
per call, JSON inside. A turn without calls is the model's answer. A call that cannot be read (broken JSON, no name,
arguments that are no object) is answered with `MALFORMED`, which tells the model the format, and counted as a tool
error.

Standard library only: the registered model ships this module and reads its answers with it
(components/tracking/registered_model.py).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

CALL = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.S)
MALFORMED = ('error: malformed tool call ({reason}); write <tool_call>{{"name": "TOOL", "arguments": {{...}}}}'
             "</tool_call>")


@dataclass(frozen=True)
class ToolCall:
    """One call the model wrote: a tool's name and its arguments."""

    name: str
    arguments: dict[str, Any]


@dataclass(frozen=True)
class ParsedTurn:
    """The calls of one model turn, or why one of them could not be read."""

    calls: list[ToolCall]
    malformed: str | None = None  # the reason, when a call could not be read

    @property
    def wants_tools(self) -> bool:
        return bool(self.calls) or self.malformed is not None


def parse_tool_calls(text: str, tokenizer: Any = None) -> ParsedTurn:
    """The calls in a model turn's text (`tokenizer`: its own response parser, when it has one)."""
    if tokenizer is not None and _has_response_parser(tokenizer):
        parsed = _with_response_parser(text, tokenizer)
        if parsed is not None:
            return parsed
    calls = []
    for match in CALL.finditer(text):
        try:
            payload = json.loads(match.group(1))
        except json.JSONDecodeError as err:
            return ParsedTurn(calls, f"not JSON: {err.msg} at character {err.pos}")
        if not isinstance(payload, dict) or not isinstance(payload.get("name"), str):
            return ParsedTurn(calls, "no tool name")
        arguments = payload.get("arguments", {})
        if isinstance(arguments, str):  # some models write the arguments as a JSON string
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError:
                return ParsedTurn(calls, "arguments are not a JSON object")
        if not isinstance(arguments, dict):
            return ParsedTurn(calls, "arguments are not a JSON object")
        calls.append(ToolCall(payload["name"], arguments))
    return ParsedTurn(calls)


def _has_response_parser(tokenizer: Any) -> bool:
    return callable(getattr(tokenizer, "parse_response", None)) and (
        getattr(tokenizer, "response_schema", None) is not None or getattr(tokenizer, "response_template", None))


def _with_response_parser(text: str, tokenizer: Any) -> ParsedTurn | None:
    """Calls read by the tokenizer's own parser; None when it cannot read the turn (the plain format then)."""
    try:
        parsed = tokenizer.parse_response(text)
    except Exception:  # noqa: BLE001 - a parser that fails on a turn leaves it to the plain format
        return None
    calls = []
    for call in (parsed or {}).get("tool_calls") or []:
        function = call.get("function", call)
        if not isinstance(function.get("name"), str) or not isinstance(function.get("arguments", {}), dict):
            return ParsedTurn(calls, "no tool name or arguments")
        calls.append(ToolCall(function["name"], dict(function.get("arguments", {}))))
    return ParsedTurn(calls)
