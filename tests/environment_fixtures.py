"""Environments imported by tests through `module:factory` names, as users' own are, and a tiny model that can play
episodes (a chat template, which the embedded default has not)."""

from __future__ import annotations

import string
from pathlib import Path

CHATML = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' "
          "+ '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


class GameServerDown:
    """An environment whose game server does not answer: `reset` raises the user's own ConnectionError."""

    def reset(self, record):
        raise ConnectionError("game server unreachable at 10.0.0.7:7777 (Connection refused)")

    def step(self, turn):
        return {"done": True, "reward": 0.0}


def game_server_down() -> GameServerDown:
    return GameServerDown()


def build_chat_model(out: Path, seed: int = 0) -> Path:
    """A randomly initialised one-layer Llama with a character tokenizer and SmolLM2's ChatML template, saved to
    `out` (a local model directory for `model.name_or_path`)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from components.engine.models.modeling import build_char_tokenizer

    tokenizer = build_char_tokenizer([string.printable])
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tokenizer.eos_token = "<|im_end|>"
    tokenizer.chat_template = CHATML
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=512,
                         tie_word_embeddings=True, pad_token_id=tokenizer.pad_token_id,
                         eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.bos_token_id)
    torch.manual_seed(seed)
    LlamaForCausalLM(config).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out
