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
from components.engine.models.prompt_text import render


def uses_chat_template(cfg: PromptConfig, tokenizer) -> bool:
    has_template = bool(getattr(tokenizer, "chat_template", None))
    if cfg.chat_template == "always" and not has_template:
        raise DataError("prompt.chat_template: 'always', but the tokenizer has no chat template")
    return cfg.chat_template == "always" or (cfg.chat_template == "auto" and has_template)


def plain_text_start(tokenizer) -> str:
    """The special tokens the tokenizer itself puts before plain text, as text ("<bos>" for Gemma's and Llama's
    tokenizers, "" for most others): a base model read without the start it was trained with is read out of its
    distribution. Prompts are encoded without special tokens (a chat template writes its own), so a plain prompt
    carries this start in its text."""
    probe = "1"
    added = tokenizer(probe).input_ids
    plain = tokenizer(probe, add_special_tokens=False).input_ids
    starts = [k for k in range(len(added) - len(plain) + 1) if added[k:k + len(plain)] == plain]
    return tokenizer.decode(added[:starts[0]]) if starts and starts[0] else ""


class PromptFormatter:
    """Callable record -> model input text."""

    def __init__(self, cfg: PromptConfig, tokenizer):
        self.template, self.system, self.tokenizer = cfg.template, cfg.system, tokenizer
        self.chat = uses_chat_template(cfg, tokenizer)
        self.start = "" if self.chat else plain_text_start(tokenizer)

    def __call__(self, record: dict[str, Any]) -> str:
        try:
            return render(record, self.template, self.system, self.chat, self.start,
                          self.tokenizer.apply_chat_template)
        except KeyError as err:
            raise DataError(f"prompt.template uses field {err} that record {record.get('id')!r} does not have") from err

    def settings(self) -> dict[str, Any]:
        """What the served model hands `prompt_text.render` (which it ships) to format prompts identically."""
        return {"template": self.template, "system": self.system, "chat": self.chat, "start": self.start}


def token_counts(tokenizer: Any, texts: Sequence[str]) -> list[int]:
    """Each text's token count without special tokens, as `tokenizer(texts, add_special_tokens=False)` counts it, in
    one batch. A fast tokenizer whose backend pads and truncates nothing is asked directly: the same Rust encoding,
    without transformers' per-text conversion to Python lists (much of the cost on a large file)."""
    backend = getattr(tokenizer, "backend_tokenizer", None) if getattr(tokenizer, "is_fast", False) else None
    if (backend is not None and backend.padding is None and backend.truncation is None
            and backend.encode_special_tokens == bool(getattr(tokenizer, "split_special_tokens", False))):
        return [len(encoding.ids) for encoding in backend.encode_batch(list(texts), add_special_tokens=False)]
    return [len(ids) for ids in tokenizer(list(texts), add_special_tokens=False).input_ids] if texts else []


def longest_row(tokenizer: Any, format_prompt: Callable[[dict[str, Any]], str], records: Sequence[dict[str, Any]],
                completion_length: int) -> int:
    """Tokens in the longest formatted prompt of `records` plus `completion_length` (at least 1 without records)."""
    longest = max(token_counts(tokenizer, [format_prompt(r) for r in records]), default=1)
    return longest + completion_length
