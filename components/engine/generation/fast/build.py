"""Building the prompt-once forward for a model: only for architectures it knows, and only once it has checked
itself against the Hugging Face forward it replaces (`check.py`)."""

from __future__ import annotations

from typing import Any

from components.engine.generation.fast import check
from components.engine.generation.fast.families import SUPPORTED_MODEL_TYPES
from components.engine.generation.fast.fastlm import PrefixSharedLM
from components.engine.generation.fast.pieces import FastOptions
from components.engine.generation.fast.rows import full_attention


def checked_prefix_shared_lm(model: Any, vocab_size: int | None = None, max_length: int | None = None,
                             completion_length: int | None = None,
                             options: FastOptions = FastOptions()) -> PrefixSharedLM | None:
    """A checked instance, or None when the architecture is unsupported or disagrees with Hugging Face.

    `max_length` is the longest row (prompt + completion tokens) it will see; the self-check runs rows that long,
    with `completion_length` completion tokens. Unset: the model's context length. Models whose attention is not
    full over such a row (a sliding window shorter than it, per-layer attention types other than full) and models
    with attention dropout (this forward applies none, so it would differ in train mode) get None: the plain Hugging
    Face forward. A model whose rotary embedding is not the standard one is checked again with the plain rotation.
    The checks run on the decoder's representative layers (`check.representative_layers`).
    """
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    config = getattr(base, "config", None)
    if getattr(config, "model_type", None) not in SUPPORTED_MODEL_TYPES:
        return None
    longest = max_length or getattr(config, "max_position_embeddings", None) or 4096
    if not full_attention(config, longest) or float(getattr(config, "attention_dropout", 0.0) or 0.0) > 0:
        return None
    completion = max(2, min(completion_length or 4, longest - 2))
    prompt = max(2, min(longest, check.MAX_CHECK_LENGTH) - completion)
    fast = PrefixSharedLM(model, options)
    vocab = vocab_size or config.vocab_size
    with check.representative_layers(fast):
        if not check.matches_reference_forward(fast, vocab, prompt, completion):
            fast = fast.with_options(complex_rotary=False)  # e.g. a rotary variant whose halves differ
            if not check.matches_reference_forward(fast, vocab, prompt, completion):
                return None
        return fast if check.trains_like_reference_forward(fast, vocab) else None
