"""Turn a record into the text the model sees: a template, an optional system prompt, and the
tokenizer's chat template (with the generation prompt) for instruct models.

Data stays raw on disk; formatting happens where prompts meet the model (sft, grpo, evaluate,
validate's token counts, and the served pyfunc model, which carries the same settings).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from components.config import PromptConfig
from components.data.records import DataError


def uses_chat_template(cfg: PromptConfig, tokenizer) -> bool:
    has_template = bool(getattr(tokenizer, "chat_template", None))
    if cfg.chat_template == "always" and not has_template:
        raise DataError("prompt.chat_template: 'always', but the tokenizer has no chat template")
    return cfg.chat_template == "always" or (cfg.chat_template == "auto" and has_template)


class PromptFormatter:
    """Callable record -> model input text."""

    def __init__(self, cfg: PromptConfig, tokenizer):
        self.template, self.system, self.tokenizer = cfg.template, cfg.system, tokenizer
        self.chat = uses_chat_template(cfg, tokenizer)

    def __call__(self, record: dict[str, Any]) -> str:
        try:
            text = self.template.format(**record)
        except KeyError as err:
            raise DataError(f"prompt.template uses field {err} that record {record.get('id')!r} does not have") from err
        if self.chat:
            messages = ([{"role": "system", "content": self.system}] if self.system else []) + \
                       [{"role": "user", "content": text}]
            return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return f"{self.system}\n{text}" if self.system else text

    def settings(self) -> dict[str, Any]:
        """What the served model needs to format prompts identically."""
        return {"template": self.template, "system": self.system, "chat": self.chat}


def longest_row(tokenizer: Any, format_prompt: Callable[[dict[str, Any]], str], records: Sequence[dict[str, Any]],
                completion_length: int) -> int:
    """Tokens in the longest formatted prompt of `records` plus `completion_length` (at least 1 without records)."""
    longest = max((len(tokenizer(format_prompt(r), add_special_tokens=False).input_ids) for r in records), default=1)
    return longest + completion_length
