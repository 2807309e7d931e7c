"""Chat-templated tokenizers for episode tests: one character a token, the chat markers one token each, EOS the
end-of-turn marker (as in SmolLM2's ChatML), so every position of a conversation can be checked by hand."""

from __future__ import annotations

import string

# SmolLM2-135M-Instruct's template (no tool format: tools go in the system message).
CHATML = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' "
          "+ '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")

# A Hermes-style template with a tool format of its own (Qwen2.5's layout, shortened).
HERMES = (
    "{%- if tools %}<|im_start|>system\n# Tools\n{%- for tool in tools %}\n{{ tool | tojson }}{%- endfor %}"
    "<|im_end|>\n{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'assistant' %}<|im_start|>assistant\n{{ message.content }}"
    "{%- for call in message.tool_calls or [] %}<tool_call>\n{\"name\": \"{{ call.function.name }}\", "
    "\"arguments\": {{ call.function.arguments | tojson }}}\n</tool_call>{%- endfor %}<|im_end|>\n"
    "{%- elif message.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ message.content }}\n</tool_response>"
    "<|im_end|>\n"
    "{%- else %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}")


def chat_tokenizer(template: str = CHATML):
    """Every printable character a token; <|im_start|> and <|im_end|> (EOS) special tokens."""
    from components.engine.models.modeling import build_char_tokenizer

    tokenizer = build_char_tokenizer([string.printable])
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tokenizer.eos_token = "<|im_end|>"
    tokenizer.chat_template = template
    return tokenizer
