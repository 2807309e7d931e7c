"""The pieces of a decoder layer that the prompt-once forward and its decoder compose, over the Hugging Face model's
own submodules: norms, rotated q|k|v, attention, the rest of a layer, the vocabulary head. Written around Llama's
layout; what another family does differently is its entry in `families.py`.

Weights, gradients, optimizer state and LoRA adapters stay the Hugging Face model's. Each forward or decoding run
concatenates q|k|v into one matrix (gradients flow back through the cat) and, without a gradient, merges LoRA as
W + s * B @ A (`fused_weights`). In float32/float64 the rotary embedding is one complex multiply instead of Hugging
Face's `x * cos + rotate_half(x) * sin`: the fused q|k weight rows are reordered within each head so that dims i and
i + d/2 sit side by side, which makes each pair a complex number to rotate by e^(i*theta). Queries and keys get the
same order, so their dot products, the attention and the outputs are unchanged; only cached keys are stored reordered.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import torch

from components.engine.generation.fast.families import family_of
from components.engine.generation.fast.head import LinearHead
from components.engine.generation.fast.layers import LayerTypeRotary, LayerWeights, Rotary, fuse_qkv, plain_linear, rope
from components.engine.generation.fast.matmul import linear as matmul_linear
from components.engine.generation.fast.rmsnorm import rms_norm

# On the CPU, softmax over fewer values than this is far slower per row (docs/performance.md): rows are padded.
SOFTMAX_MIN_WIDTH = 16
SMALL_DECODE_KEYS = 16  # up to this many cached keys, decoding attention is a broadcast multiply-sum


@dataclass(frozen=True)
class FastOptions:
    """How the prompt-once path computes; fixed when it is built (`fast.build` chooses what its self-check passes)."""

    complex_rotary: bool = True
    """Rotate q|k as complex pairs (float32/float64, no per-head q/k norms); off for rotary variants whose halves
    differ, which the self-check finds."""
    attention_rows: Literal["auto", "group", "completion"] = "auto"
    """How training and reference forwards arrange attention (`attention.attention_rows`); the check runs both."""
    onednn_matmul: bool = True
    """Large float32 products on the CPU go to oneDNN's kernels (`matmul.py`); False: PyTorch's own."""
    distinct_rows: bool = True
    """Log-probs of a row that repeats an earlier row's prompt and completion are computed once (`rows.py`)."""
    gradient_checkpointing: bool = False
    """Training forwards keep each decoder layer's input only and recompute the layer in backward."""


class ModelPieces:
    """A Hugging Face decoder's submodules (a family of `families.FAMILIES`) and the operations composed from them."""

    def __init__(self, model: Any, options: FastOptions):
        base = model.get_base_model() if hasattr(model, "get_base_model") else model  # peft: LoRA modules stay in
        self.model, self.options = model, options
        self.decoder, self.lm_head = base.model, base.lm_head
        config = base.config
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = getattr(config, "num_key_value_heads", None) or self.num_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.num_heads
        self.family = family_of(config)
        attention = self.decoder.layers[0].self_attn
        self.scaling = float(getattr(attention, "scaling", None) or self.head_dim ** -0.5)
        self.attention_softcap = getattr(attention, "attn_logit_softcapping", None)  # Gemma 2: tanh-capped scores
        self.final_softcap = getattr(config, "final_logit_softcapping", None)  # Gemma 2: tanh-capped logits
        self.dropouts = [m for m in model.modules() if isinstance(m, torch.nn.Dropout)]

    @property
    def layers(self) -> Any:
        return self.decoder.layers

    @property
    def dtype(self) -> torch.dtype:
        """The dtype the model computes in: its embedding's (LoRA adapters may be kept in float32 beside it)."""
        return self.decoder.embed_tokens.weight.dtype

    @property
    def vocab_size(self) -> int:
        return getattr(self.lm_head, "out_features", None) or self.decoder.embed_tokens.num_embeddings

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.decoder.embed_tokens(ids)

    def final_norm(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.decoder.norm, x)

    def positions(self, x: torch.Tensor, position_ids: torch.Tensor) -> Rotary | LayerTypeRotary:
        """The rotary embedding of `position_ids` (one table, or one per attention type: `Family`)."""
        if self.family.rotary_per_layer_type:
            kinds = sorted(set(self.decoder.config.layer_types))
            return LayerTypeRotary({kind: self._rotary(self.decoder.rotary_emb(x, position_ids, kind))
                                    for kind in kinds})
        return self._rotary(self.decoder.rotary_emb(x, position_ids))

    @staticmethod
    def _rotary(cos_sin: tuple[torch.Tensor, torch.Tensor]) -> Rotary:
        cos, sin = cos_sin
        return Rotary(cos.unsqueeze(1), sin.unsqueeze(1))  # broadcast over heads

    def rotates_as_complex(self, dtype: torch.dtype) -> bool:
        """Complex rotation needs a complex dtype (none for bfloat16) and q|k without per-head norms."""
        return (self.options.complex_rotary and dtype in (torch.float32, torch.float64)
                and not hasattr(self.decoder.layers[0].self_attn, "q_norm"))

    def fused_weights(self, merge_lora: bool = False) -> list[LayerWeights]:
        """Per layer, each projection as a plain matmul where possible, q|k|v fused into one.

        A projection that is not a plain `nn.Linear` is called as a module, except that with `merge_lora`
        (decoding and reference forwards: no gradient) a LoRA-wrapped one becomes one matmul with
        W + s * B @ A (or W alone while its adapters are disabled): 2 matmuls, a scale and an add fewer
        per projection and decode step, and the q|k|v fusion applies again. Built once per
        forward or decoding run; gradients flow back through the cat. `qkv` rotates paired rows as
        complex numbers and the others with cos/sin, so the rows' order and the rotation cannot disagree.
        """
        fused = []
        for layer in self.decoder.layers:
            attn, mlp = layer.self_attn, layer.mlp
            q, k, v = (plain_linear(m, merge_lora) for m in (attn.q_proj, attn.k_proj, attn.v_proj))
            qkv = None
            if q is not None and k is not None and v is not None:
                paired = self.rotates_as_complex(q[0].dtype)
                heads = (self.num_heads, self.num_kv_heads) if paired else None
                weight = fuse_qkv(q[0], k[0], v[0], heads)
                has_bias = q[1] is not None and k[1] is not None and v[1] is not None
                bias = fuse_qkv(q[1], k[1], v[1], heads) if has_bias else None
                qkv = (weight, bias, paired)
            gate, up = plain_linear(mlp.gate_proj, merge_lora), plain_linear(mlp.up_proj, merge_lora)
            gate_up = None
            if gate is not None and up is not None and gate[1] is None and up[1] is None:
                gate_up = (gate[0], up[0])
            fused.append(LayerWeights(qkv, plain_linear(attn.o_proj, merge_lora), gate_up,
                                      plain_linear(mlp.down_proj, merge_lora)))
        return fused

    def norm(self, module: Any, x: torch.Tensor) -> torch.Tensor:
        if type(module).__name__.endswith("RMSNorm") and hasattr(module, "variance_epsilon"):
            return rms_norm(x, module.weight, module.variance_epsilon)
        return module(x)

    def qkv(self, layer: Any, fused: LayerWeights, h: torch.Tensor, rotary: Rotary):
        """Rotated queries [B, H, L, d] and keys, values [B, Hkv, L, d] (views where the projection is fused)."""
        parts = self._qkv_parts(layer, fused, h, rotary)
        if len(parts) == 3:
            return parts
        qk, v = parts
        return qk[:, :self.num_heads], qk[:, self.num_heads:], v

    def qkv_heads(self, layer: Any, fused: LayerWeights, h: torch.Tensor, rotary: Rotary) -> torch.Tensor:
        """`_qkv` as one tensor [B, H + 2 Hkv, L, d], for callers that split it by token and by head: views whose
        backward is one cat, where slicing three tensors costs a zero-filled gradient per slice."""
        return torch.cat(self._qkv_parts(layer, fused, h, rotary), dim=1)

    def _qkv_parts(self, layer: Any, fused: LayerWeights, h: torch.Tensor,
                   rotary: Rotary | LayerTypeRotary) -> list[torch.Tensor]:
        """[rotated q|k, v] from the fused projection, else [q, k, v]; each [B, heads, L, d]."""
        attn = layer.self_attn
        rotary = rotary.of_layer(layer)
        b, length, _ = h.shape
        heads, kv_heads, d = self.num_heads, self.num_kv_heads, self.head_dim
        cos, sin = rotary.cos, rotary.sin
        if fused.qkv is not None and not hasattr(attn, "q_norm"):
            # One matmul for q|k|v and one rotation for q|k together: fewer small ops per layer.
            weight, bias, paired = fused.qkv
            qkv = self.linear(h, weight, bias)
            qk, v = qkv.split([(heads + kv_heads) * d, kv_heads * d], -1)
            if paired:  # rows paired by `fused_weights`: rotate (x_i, x_i+d/2) as one complex number
                pairs = torch.view_as_complex(qk.unflatten(-1, (heads + kv_heads, d // 2, 2))).transpose(1, 2)
                qk = torch.view_as_real(pairs * rotary.turn).flatten(-2)
            else:
                qk = rope(qk.view(b, length, heads + kv_heads, d).transpose(1, 2), cos, sin)
            return [qk, v.view(b, length, kv_heads, d).transpose(1, 2)]
        if fused.qkv is not None:  # never paired: models with q/k norms rotate with cos/sin
            weight, bias, _ = fused.qkv
            q, k, v = self.linear(h, weight, bias).split([heads * d, kv_heads * d, kv_heads * d], -1)
        else:
            q, k, v = attn.q_proj(h), attn.k_proj(h), attn.v_proj(h)
        q = q.view(b, length, heads, d).transpose(1, 2)
        k = k.view(b, length, kv_heads, d).transpose(1, 2)
        v = v.view(b, length, kv_heads, d).transpose(1, 2)
        if hasattr(attn, "q_norm"):  # Qwen3 normalises queries and keys per head before RoPE
            q, k = attn.q_norm(q), attn.k_norm(k)
        return [rope(q, cos, sin), rope(k, cos, sin), v]

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return matmul_linear(x, weight, bias, onednn=self.options.onednn_matmul)

    def merge_heads(self, attn_out: torch.Tensor) -> torch.Tensor:
        """[B, H, L, d] -> [B, L, H * d]."""
        b, _, length, _ = attn_out.shape
        return attn_out.transpose(1, 2).reshape(b, length, self.num_heads * self.head_dim)

    def finish_layer(self, layer: Any, fused: LayerWeights, x: torch.Tensor, attn_out: torch.Tensor) -> torch.Tensor:
        """Output projection, residual and MLP; `attn_out` is [B, L, H * d] (heads merged). With sandwich norms
        (`Family.sandwich_norms`) each sublayer's output is normed before its residual add."""
        sandwich = self.family.sandwich_norms
        out = layer.self_attn.o_proj(attn_out) if fused.o is None else self.linear(attn_out, *fused.o)
        x = x + (self.norm(layer.post_attention_layernorm, out) if sandwich else out)
        h = self.norm(layer.pre_feedforward_layernorm if sandwich else layer.post_attention_layernorm, x)
        mlp = layer.mlp
        if fused.gate_up is not None:
            gate, up = self.linear(h, fused.gate_up[0]), self.linear(h, fused.gate_up[1])
            hidden = mlp.act_fn(gate) * up
            out = mlp.down_proj(hidden) if fused.down is None else self.linear(hidden, *fused.down)
        else:
            out = mlp(h)
        return x + (self.norm(layer.post_feedforward_layernorm, out) if sandwich else out)

    @staticmethod
    def bias(keep: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        # A finite fill keeps fully masked rows (left padding) finite instead of NaN.
        zero = torch.zeros((), dtype=dtype, device=keep.device)
        return torch.where(keep, zero, torch.finfo(dtype).min)

    @staticmethod
    def _softmax(scores: torch.Tensor) -> torch.Tensor:
        """Softmax over the last dim; on CPU, rows shorter than `SOFTMAX_MIN_WIDTH` are padded with -inf (exact
        zeros after exp) to take PyTorch's vectorised kernel. Returns a view of the real columns."""
        width = scores.shape[-1]
        if width >= SOFTMAX_MIN_WIDTH or scores.device.type != "cpu":
            return torch.softmax(scores, dim=-1)
        padded = torch.nn.functional.pad(scores, (0, SOFTMAX_MIN_WIDTH - width), value=float("-inf"))
        return torch.softmax(padded, dim=-1)[..., :width]

    def attend(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        """Grouped-query attention with an additive mask: q [B, H, L, d], keys and values [B, Hkv, K, d], bias
        [B, 1, 1, L, K]; returns [B, H, L, d].

        The H / Hkv query heads that share a key/value head are folded into the query rows ([B, Hkv, rep * L,
        d]), so one batched matmul serves them all: broadcasting [B, Hkv, rep, L, d] against the keys would make
        matmul copy them rep times (docs/performance.md has what that cost).
        """
        b, heads, length, d = q.shape
        kv, rep = self.num_kv_heads, heads // self.num_kv_heads
        if self.attention_softcap:
            return self._softcapped_attend(q, keys, values, bias)
        if q.dtype not in (torch.float32, torch.float64):
            # Half precision: PyTorch's fused attention, which sums in float32 as Hugging Face's forward does; scores
            # rounded to bfloat16 before the softmax would be off by up to 1/8 at magnitudes near 30.
            return torch.nn.functional.scaled_dot_product_attention(q, keys, values, attn_mask=bias[:, :, 0],
                                                                    scale=self.scaling, enable_gqa=rep > 1)
        if length == 1 and keys.shape[2] <= SMALL_DECODE_KEYS:
            # One query over a very short cache: a broadcast multiply-sum beats tiny batched matmuls.
            qg, keys, values = q.view(b, kv, rep, 1, d), keys.unsqueeze(2), values.unsqueeze(2)
            probs = self._softmax(torch.add(bias, (qg * keys).sum(-1).unsqueeze(-2), alpha=self.scaling))
            return (probs.transpose(-1, -2) * values).sum(-2, keepdim=True).flatten(1, 2)
        scores = (q.reshape(b, kv, rep * length, d) @ keys.transpose(-1, -2)).view(b, kv, rep, length, -1)
        # bias + scaling * scores in one operator: the same values as scaling then adding (the mask is 0 or finfo.min)
        probs = self._softmax(torch.add(bias, scores, alpha=self.scaling)).view(b, kv, rep * length, -1)
        return (probs @ values).view(b, heads, length, d)

    def _softcapped_attend(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                           bias: torch.Tensor) -> torch.Tensor:
        """`attend` with scores capped as `cap * tanh(scores / cap)` before the mask (Gemma 2), as Hugging Face's
        eager attention computes it: products in the model's dtype, the softmax in float32."""
        b, heads, length, d = q.shape
        kv, rep, cap = self.num_kv_heads, heads // self.num_kv_heads, self.attention_softcap
        scores = (q.reshape(b, kv, rep * length, d) @ keys.transpose(-1, -2)).view(b, kv, rep, length, -1)
        scores = torch.tanh(scores * (self.scaling / cap)) * cap + bias
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype).view(b, kv, rep * length, -1)
        return (probs @ values).view(b, heads, length, d)

    def logits(self, hidden: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
        """Vocabulary logits / temperature; a bias-free head without soft-capping takes the division on the (much
        smaller) hidden state."""
        if temperature == 1.0:
            return self.head(hidden)
        if type(self.lm_head) is torch.nn.Linear and self.lm_head.bias is None and not self.final_softcap:
            return self.head(hidden / temperature)
        return self.head(hidden) / temperature

    def vocab_head(self, temperature: float = 1.0) -> Callable[[torch.Tensor], torch.Tensor]:
        """hidden -> `logits(hidden, temperature)`; a `LinearHead` (fast/head.py: its token log-probs through one
        vocabulary-wide buffer) where the head is a plain `nn.Linear` without hooks or soft-capping and any
        temperature is taken on the hidden state, as `logits` takes it."""
        head = self.lm_head
        if not self._plain_head() or self.final_softcap or (temperature != 1.0 and head.bias is not None):
            return lambda hidden: self.logits(hidden, temperature)
        return LinearHead(head.weight, head.bias, self.options.onednn_matmul, temperature)

    def _plain_head(self) -> bool:
        """The head is an `nn.Linear` itself (not a subclass or a wrapper) with no hooks: its product can be taken
        from its weight and bias."""
        head = self.lm_head
        return type(head) is torch.nn.Linear and not (head._forward_hooks or head._forward_pre_hooks)

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        """The vocabulary head: `linear` (oneDNN for large products) for a plain `nn.Linear` without hooks, else
        the module itself (so forward hooks on it still run); capped as `cap * tanh(logits / cap)` where the model
        caps its logits (Gemma 2)."""
        head = self.lm_head
        if self._plain_head():
            out = self.linear(hidden, head.weight, head.bias)
        else:
            out = head(hidden)
        return torch.tanh(out / self.final_softcap) * self.final_softcap if self.final_softcap else out
