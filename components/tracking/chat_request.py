"""OpenAI-style chat requests and answers for the served model, in the pipeline's own terms.

A request holds one conversation: `messages` (system, user, assistant and tool messages; an assistant's `tool_calls`
carry their `arguments` as JSON text, as OpenAI sends them), `tools` (function schemas; absent: the tools the model
was trained with; `[]`: none) and `max_tokens`. The answer is an OpenAI `chat.completion`: the model's calls in
`tool_calls` (`finish_reason: "tool_calls"`), otherwise its text in `content`.

Standard library only: the registered model ships this module (components/tracking/registered_model.py).
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Sequence
from typing import Any

ROLES = ("system", "user", "assistant", "tool")


class RequestError(ValueError):
    """A chat request the model cannot answer, said in one line naming the field."""


def episode_messages(messages: Any) -> list[dict[str, Any]]:
    """The request's messages as an episode holds them: text `content`, each call's `arguments` an object, each `tool`
    message named after the call it answers (its `tool_call_id`). The last message must not be the assistant's."""
    if not isinstance(messages, list) or not messages:
        raise RequestError("messages: a non-empty list of {\"role\", \"content\"} objects expected")
    names: dict[str, str] = {}  # tool_call_id -> the tool it called
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or message.get("role") not in ROLES:
            raise RequestError(f"messages[{i}]: an object whose role is one of {', '.join(ROLES)} expected")
        episode = {"role": message["role"], "content": _text(message.get("content"), f"messages[{i}].content")}
        if message["role"] == "assistant" and message.get("tool_calls"):
            calls = message["tool_calls"]
            if not isinstance(calls, list):
                raise RequestError(f"messages[{i}].tool_calls: a list of calls expected")
            episode["tool_calls"] = [_call(call, f"messages[{i}].tool_calls[{j}]", names) for j, call in
                                     enumerate(calls)]
        if message["role"] == "tool":
            name = message.get("name") or names.get(str(message.get("tool_call_id")))
            if name:
                episode["name"] = str(name)
        out.append(episode)
    if out[-1]["role"] == "assistant":
        raise RequestError("messages: the last message is the assistant's; there is nothing to answer")
    return out


def _text(content: Any, where: str) -> str:
    """A message's content as text: a string, nothing (a call without words), or OpenAI's list of text parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text" for p in content):
        return "".join(str(p.get("text", "")) for p in content)
    raise RequestError(f"{where}: text (or a list of text parts) expected")


def _call(call: Any, where: str, names: dict[str, str]) -> dict[str, Any]:
    """One OpenAI call as the pipeline writes it: `{"type": "function", "function": {"name", "arguments": {...}}}`."""
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise RequestError(f"{where}: {{\"type\": \"function\", \"function\": {{\"name\", \"arguments\"}}}} expected")
    arguments = function.get("arguments") or {}
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError as err:
            raise RequestError(f"{where}.function.arguments: not JSON ({err.msg} at character {err.pos})") from err
    if not isinstance(arguments, dict):
        raise RequestError(f"{where}.function.arguments: a JSON object expected")
    if call.get("id"):
        names[str(call["id"])] = function["name"]
    return {"type": "function", "function": {"name": function["name"], "arguments": arguments}}


def offered_tools(tools: Any, trained: Sequence[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """The tools a request offers: its own (`[]`: none), or the ones the model was trained with when it names none."""
    if tools is None:
        return list(trained) if trained else None
    if not isinstance(tools, list) or not all(
            isinstance(t, dict) and isinstance(t.get("function"), dict) and isinstance(t["function"].get("name"), str)
            for t in tools):
        raise RequestError("tools: a list of {\"type\": \"function\", \"function\": {\"name\", \"description\", "
                           "\"parameters\"}} expected")
    return list(tools) or None


def max_tokens(value: Any, default: int) -> int:
    """The request's `max_tokens` (a positive whole number), or the model's default when it gives none."""
    if value is None or value != value:  # absent, or NaN where a batch's other rows gave one
        return default
    if isinstance(value, bool) or not float(value).is_integer() or value < 1:
        raise RequestError(f"max_tokens: a positive whole number expected, got {value!r}")
    return int(value)


def chat_completion(content: str, calls: Sequence[tuple[str, dict[str, Any]]], ended: bool,
                    usage: tuple[int, int], model: str) -> dict[str, Any]:
    """An OpenAI `chat.completion`: `calls` (name, arguments) in `tool_calls` with their arguments as JSON text and
    `finish_reason: "tool_calls"`, the text outside them (if any) as `content`; without calls the text as `content`,
    `finish_reason` "stop", or "length" when the answer ran out of tokens (`ended` False). `usage`: (prompt tokens,
    completion tokens)."""
    message: dict[str, Any] = {"role": "assistant", "content": content or None}
    finish = "stop" if ended else "length"
    if calls:
        message["tool_calls"] = [{"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                                  "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)}}
                                 for name, arguments in calls]
        finish = "tool_calls"
    elif message["content"] is None:
        message["content"] = ""
    prompt, completion = usage
    return {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
            "model": model, "choices": [{"index": 0, "message": message, "finish_reason": finish}],
            "usage": {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}}
