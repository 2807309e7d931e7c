"""Conversations as tokens, the way the model sees them: the prompt rendered by its chat template (tools offered in
the template's own format where it has one, else in the system message), and what a tool or environment answers
rendered as the tokens between the end of one model turn (its EOS) and the start of the next.

Standard library only: the registered model ships this module and lays out the conversations it answers with it
(components/tracking/registered_model.py), as training did."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

SENTINEL = "tool_name_0f9d"


def supports_tools(tokenizer: Any) -> bool:
    """Does the chat template render a whole tool exchange (the call's name and arguments, the tool's answer)?
    Some templates silently drop `tool_calls` or tool messages; those count as having no tool format."""
    if not getattr(tokenizer, "chat_template", None):
        return False
    call = {"type": "function", "function": {"name": SENTINEL, "arguments": {"arg_4c1e": "value_9a7b"}}}
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "", "tool_calls": [call]},
                {"role": "tool", "name": SENTINEL, "content": "content_e2d8"}]
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False)
    except Exception:  # noqa: BLE001 - a template that cannot render tool messages has no tool format
        return False
    return all(part in text for part in (SENTINEL, "arg_4c1e", "value_9a7b", "content_e2d8"))


def tools_text(schemas: Sequence[dict[str, Any]]) -> str:
    """How tools are offered to a model whose chat template has no tool format of its own (the plain-text format
    `calls.parse_tool_calls` reads); `schemas` as `{"type": "function", "function": {...}}`."""
    listed = "\n".join(json.dumps(s["function"], ensure_ascii=False) for s in schemas)
    return ("You can call these tools:\n" + listed + "\nTo call one, write <tool_call>{\"name\": NAME, \"arguments\": "
            "{...}}</tool_call>; its result comes back in the next message. Write the answer without a tool call.")


class ChatFormat:
    """A tokenizer's chat template, for episodes: the first messages as prompt ids, the environment's answers as the
    ids that follow a model turn. `tools`: the JSON schemas offered (None: no tools)."""

    def __init__(self, tokenizer: Any, tools: Sequence[dict[str, Any]] | None = None):
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("episodes need a chat template (the tokenizer has none)")
        self.tokenizer, self.tools = tokenizer, list(tools) if tools else None
        self.native_tools = bool(self.tools) and supports_tools(tokenizer)

    def _render(self, messages: Sequence[dict[str, Any]], generation_prompt: bool) -> list[int]:
        tools = self.tools if self.native_tools else None
        ids = self.tokenizer.apply_chat_template(list(messages), tools=tools, add_generation_prompt=generation_prompt,
                                                 tokenize=True, return_dict=False)
        return list(ids["input_ids"] if isinstance(ids, dict) else ids)

    def prompt_ids(self, messages: Sequence[dict[str, Any]]) -> list[int]:
        """The episode's first messages, ending with the generation prompt of the model's first turn."""
        return self._render(messages, generation_prompt=True)

    def answer_ids(self, messages: Sequence[dict[str, Any]]) -> list[int]:
        """Ids of `messages` (a tool's or the environment's answer) after a model turn that ended with EOS, through the
        generation prompt of the model's next turn: the template rendered with and without them after a dummy
        exchange, the difference taken from the dummy turn's EOS on (TRL's `_get_tool_suffix_ids`, the same rule)."""
        name = next((m.get("name") for m in messages if m.get("name")), "tool")
        call = {"type": "function", "function": {"name": name, "arguments": {}}}
        dummy = [{"role": "user", "content": "dummy"}, {"role": "assistant", "content": "", "tool_calls": [call]}]
        prefix = self._render(dummy, generation_prompt=False)
        full = self._render(dummy + list(messages), generation_prompt=True)
        eos = [i for i, t in enumerate(prefix) if t == self.tokenizer.eos_token_id]
        if eos:
            prefix = prefix[: eos[-1] + 1]
        if full[: len(prefix)] != prefix:
            raise ValueError("the chat template renders an earlier turn differently once an answer follows it")
        return full[len(prefix):]

    def turn_ids(self, content: str) -> list[int]:
        """A model turn's ids as the model writes them: its text, then EOS (SFT's worked conversations)."""
        return list(self.tokenizer(content, add_special_tokens=False).input_ids) + [self.tokenizer.eos_token_id]

    def system_text(self, system: str | None, tools_prompt: str | None) -> str | None:
        """The system message: the configured one, plus the tools' description where the template offers none."""
        parts = [p for p in (system, None if self.native_tools else tools_prompt) if p]
        return "\n\n".join(parts) if parts else None


def conversation_ids(chat: ChatFormat, messages: Sequence[dict[str, Any]]) -> tuple[list[int], list[int], int]:
    """A whole conversation (system/user messages, then assistant turns and the answers between them) as
    (ids, model_mask, prompt_length): 1 on the tokens the model wrote (each assistant turn's text and its EOS), 0 on
    the prompt and on every answer, exactly as an episode lays them out."""
    first = next((i for i, m in enumerate(messages) if m["role"] == "assistant"), len(messages))
    ids = chat.prompt_ids(messages[:first])
    mask = [0] * len(ids)
    prompt_length = len(ids)
    i = first
    while i < len(messages):
        turn = chat.turn_ids(_assistant_text(messages[i]))
        ids, mask = ids + turn, mask + [1] * len(turn)
        j = i + 1
        while j < len(messages) and messages[j]["role"] != "assistant":
            j += 1
        if j > i + 1:
            answer = chat.answer_ids(messages[i + 1:j])
            ids, mask = ids + answer, mask + [0] * len(answer)
        i = j
    return ids, mask, prompt_length


def _assistant_text(message: dict[str, Any]) -> str:
    """An assistant message's text as the model writes it: its content, then its tool calls in the plain format."""
    calls = [c.get("function", c) for c in message.get("tool_calls") or []]
    written = "".join(f"<tool_call>{json.dumps({'name': c['name'], 'arguments': c.get('arguments', {})})}</tool_call>"
                      for c in calls)
    return (message.get("content") or "") + written
