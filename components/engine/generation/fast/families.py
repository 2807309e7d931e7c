"""The model families the prompt-once forward and its decoders know, one entry each: the config's model types and
what the family's decoder layer does beyond the Llama layout `pieces.ModelPieces` is written around.

What every family states in its Hugging Face modules is read from them, not listed here: the attention scale
(`self_attn.scaling`), attention and final-logit soft-capping, per-head query/key norms, the embedding's scale and the
norms' own arithmetic (Gemma's (1 + w) RMSNorm is called as its module). Sliding windows need no entry: rows no longer
than the window attend fully, and `rows.full_attention` refuses the fast path for longer ones. A new family is one
entry here; whether the fast path holds for it is decided per model at build time by the self-check against its
Hugging Face forward (`check.py`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Family:
    """A family of decoders the fast path computes."""

    name: str
    model_types: tuple[str, ...]  # the configs' `model_type`
    sandwich_norms: bool = False
    """Norms around each sublayer's output as well as its input: `post_attention_layernorm` on the attention's output
    before the residual add, `pre_feedforward_layernorm` and `post_feedforward_layernorm` around the MLP (Gemma 2, 3);
    otherwise `post_attention_layernorm` is the MLP's input norm (Llama)."""
    rotary_per_layer_type: bool = False
    """Each attention type (`config.layer_types`) has its own rotary table (Gemma 3: local layers rotate with another
    base), asked of the model's rotary embedding by type."""


LLAMA = Family("llama", ("llama", "qwen2", "qwen3", "mistral"))
FAMILIES = (
    LLAMA,
    Family("gemma2", ("gemma2",), sandwich_norms=True),
    Family("gemma3", ("gemma3_text",), sandwich_norms=True, rotary_per_layer_type=True),
)
SUPPORTED_MODEL_TYPES = tuple(t for family in FAMILIES for t in family.model_types)


def family_of(config: Any) -> Family:
    """The entry for a model config; Llama's layout for a model type no entry lists (only a self-check that passes
    lets such a model on the fast path: `build.checked_prefix_shared_lm` refuses unlisted types first)."""
    model_type = getattr(config, "model_type", None)
    return next((f for f in FAMILIES if model_type in f.model_types), LLAMA)
