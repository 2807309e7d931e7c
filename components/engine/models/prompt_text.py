"""How a record becomes the text a model reads: the one rendering, used by training (`prompting.PromptFormatter`)
and by the served model, which ships this file (`grpo_served`): standard library only."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def render(record: dict[str, Any], template: str, system: str | None, chat: bool, start: str,
           apply_chat_template: Callable[..., str]) -> str:
    """`template` filled from `record`: with `chat`, the user turn (after `system`, if any) laid out by the
    tokenizer's chat template with its generation prompt; otherwise `start` (the tokenizer's own start of text), then
    `system` on a line of its own, then the text. A field the template names and the record lacks raises KeyError."""
    text = template.format(**record)
    if chat:
        messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": text}]
        return apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return start + (f"{system}\n{text}" if system else text)
