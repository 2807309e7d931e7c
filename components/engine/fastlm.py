"""A lean forward for Llama-family models that computes each distinct prompt once.

GRPO scores G completions of the same prompt, so a plain forward over `[prompt; completion]` rows
spends most of its work re-encoding the same prompt G times. `PrefixSharedLM` runs the prompt rows
once, keeps their keys/values, and lets every completion row attend to its prompt's cache. Completion
tokens are packed: only the tokens that predict a scored token (up to each row's EOS) go through the
projections, the MLPs and the vocabulary head, so padding after an early EOS costs no matrix work;
attention alone sees them padded per row. The last completion token is never fed (its output
predicts nothing we score). Log-probs come from `token_logprobs` (one-pass backward), with the
sampling temperature applied to the hidden state rather than to the vocabulary-sized logits.
Sampling uses the same pieces with a preallocated completion KV cache, so there is no
general-purpose `generate` overhead.

It calls the model's own submodules (projections, norms, MLP, rotary embedding), so the weights,
gradients, optimizer state and LoRA adapters are the Hugging Face model's. Each forward or decoding
run concatenates q|k|v into one matrix (gradients flow back through the cat; gate and up stay two
matmuls, measured as fast as one plus its split, without the cat), and
without a gradient (sampling, the reference) merges LoRA as W + s * B @ A (`fused_weights`).

In float32/float64 the rotary embedding is one complex multiply instead of Hugging Face's
`x * cos + rotate_half(x) * sin` (five elementwise ops and their backward): the fused q|k weight
rows are reordered within each head so that dims i and i + d/2 sit side by side, which makes each
pair a complex number to rotate by e^(i*theta). Queries and keys get the same order, so their dot
products, the attention and the outputs are unchanged; only the cached keys are stored reordered.

`PrefixSharedLM.for_model` checks itself against the Hugging Face forward once and returns None
(callers fall back to the plain path) for architectures it does not know or does not match.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Literal

import torch
from torch.utils.checkpoint import checkpoint

from components.engine.logprobs import head_token_logprobs
from components.engine.matmul import linear as matmul_linear
from components.engine.rmsnorm import rms_norm
from components.engine.rollout import Rollout, completion_logprobs

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "mistral")
# On CPU, softmax over fewer values than this is ~10x slower per row (2560 rows of 12: 181 us, of 16: 20 us).
SOFTMAX_MIN_WIDTH = 16
SMALL_DECODE_KEYS = 16  # up to this many cached keys, decoding attention is a broadcast multiply-sum (measured)
# Group rows (`_attention_rows`) while the attention multiply-adds they add per layer stay under this: on 2 cores
# they were 12% faster on the tiny default (1.3M added), break even near 12M and lose beyond (40M: 7-11% slower).
GROUP_ROWS_EXTRA_WORK = 4_000_000
DECODE_CACHE_BLOCK = 32  # decoding caches start with room for this many completion tokens and double when full
MAX_CHECK_LENGTH = 1024  # self-check rows are this long at most (the attention rules above hold at any length)
CHECK_TOLERANCE = {torch.float32: 1e-3, torch.bfloat16: 0.1, torch.float16: 0.05}


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return x * cos + _rotate_half(x) * sin


def _paired_rows(t: torch.Tensor, heads: int) -> torch.Tensor:
    """A view of a projection's weight [heads * d, ...] (or bias) as [heads, d/2, 2, ...]: dims i and i + d/2 of
    each head side by side, so that the row order [0, d/2, 1, d/2 + 1, ...] costs nothing beyond the fusing cat."""
    return t.unflatten(0, (heads, 2, -1)).transpose(1, 2)


def _fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, paired_heads: tuple[int, int] | None) -> torch.Tensor:
    """q|k|v weights (or biases) in one tensor; with `paired_heads` (query heads, key/value heads) the q and k
    rows are paired for complex rotation, in the same single copy."""
    if paired_heads is None:
        return torch.cat([q, k, v])
    heads, kv_heads = paired_heads
    paired = [_paired_rows(q, heads), _paired_rows(k, kv_heads), v.unflatten(0, (kv_heads, -1, 2))]
    return torch.cat(paired).flatten(0, 2)


class Rotary:
    """One forward's rotary embedding: cos/sin [B, 1, L, d]; e^(i*theta) [B, 1, L, d/2] made on first use."""

    def __init__(self, cos: torch.Tensor, sin: torch.Tensor):
        self.cos, self.sin = cos, sin
        self._turn: torch.Tensor | None = None

    @property
    def turn(self) -> torch.Tensor:
        if self._turn is None:
            half = self.cos.shape[-1] // 2
            self._turn = torch.complex(self.cos[..., :half], self.sin[..., :half])
        return self._turn

    def at(self, offset: int) -> "Rotary":
        """The rotation of one decoding position (all positions are computed once per decoding run)."""
        return Rotary(*(t[:, :, offset:offset + 1] for t in (self.cos, self.sin)))


Linear = tuple[torch.Tensor, "torch.Tensor | None"]  # (weight, bias) of a projection used as a plain matmul


@dataclass
class LayerWeights:
    """One decoder layer's projections as plain matmuls; None where the module must be called itself."""

    qkv: tuple[torch.Tensor, torch.Tensor | None, bool] | None  # fused q|k|v weight, bias, q|k rows paired
    o: Linear | None
    gate_up: tuple[torch.Tensor, torch.Tensor] | None  # gate and up weights (no bias), two matmuls
    down: Linear | None


def plain_linear(module: Any, merge_lora: bool = False) -> Linear | None:
    """(weight, bias) such that F.linear(x, weight, bias) == module(x), or None.

    A plain `nn.Linear` gives its own. With `merge_lora`, a peft LoRA `Linear` over a plain one gives
    W + sum of s * B @ A over its active adapters (W alone while they are disabled): only for vanilla
    LoRA without dropout or a bias on B, and not while merged into W (the module then handles it).
    """
    if type(module) is torch.nn.Linear:
        return module.weight, module.bias
    base = getattr(module, "base_layer", None)
    if not merge_lora or type(base) is not torch.nn.Linear or not hasattr(module, "get_delta_weight") \
            or getattr(module, "merged", True):
        return None
    weight = base.weight
    if module.disable_adapters:
        return weight, base.bias
    for name in module.active_adapters:
        if name not in module.lora_A:
            continue
        if name in getattr(module, "lora_variant", {}) or type(module.lora_dropout[name]) is not torch.nn.Identity \
                or module.lora_B[name].bias is not None:
            return None
        weight = weight + module.get_delta_weight(name)
    return weight, base.bias


SHARED_PREFIX_MIN = 8  # prompts sharing at least this many leading tokens encode them once (fewer: not worth a pass)


def shared_prefix_length(ids: torch.Tensor, mask: torch.Tensor) -> int:
    """How many leading real tokens all rows of left-padded `ids` share, leaving each row at least one of its own."""
    if len(ids) < 2:
        return 0
    lengths = mask.sum(-1)
    span = int(lengths.min()) - 1
    if span < 1:
        return 0
    starts = ids.shape[1] - lengths
    heads = ids.gather(1, starts[:, None] + torch.arange(span, device=ids.device))  # each row's first `span` tokens
    differs = (heads != heads[:1]).any(0)
    return int(differs.int().argmax()) if bool(differs.any()) else span


def distinct_rows(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, completion_ids: torch.Tensor,
                  completion_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Rows with the same prompt (ids and mask) and the same scored completion tokens have the same log-probs.
    Returns (first: the first row of each distinct one, in row order, so groups stay together; inverse: each
    row's index into `first`), or None when no row repeats another."""
    n = len(prompt_ids)
    if n < 2:
        return None
    scored = torch.where(completion_mask.bool(), completion_ids, -1)  # tokens past the mask never count
    key = torch.cat([prompt_ids, prompt_mask.to(prompt_ids.dtype), scored.to(prompt_ids.dtype)], dim=1)
    _, inverse = torch.unique(key, dim=0, return_inverse=True)
    distinct = int(inverse.max()) + 1
    if distinct == n:
        return None
    rows = torch.arange(n, device=key.device)
    first = torch.full((distinct,), n, device=key.device).scatter_reduce(0, inverse, rows, "amin")
    order = first.argsort()  # torch.unique sorts by value; back to row order
    rank = torch.empty_like(order)
    rank[order] = torch.arange(distinct, device=key.device)
    return first[order], rank[inverse]


def group_rows_extra_work(prompts: int, width: int, length: int, rows: int, steps: int, head_width: int) -> int:
    """Attention multiply-adds per layer (query and value side each) that rows of `length` slots per prompt
    (its `width` positions and its group's tokens) cost beyond a row per prompt plus a row per completion
    (`rows` of `steps` tokens over width + steps keys); `head_width` is query heads x head dim."""
    group_scores = prompts * length * length
    completion_scores = prompts * width * width + rows * steps * (width + steps)
    return (group_scores - completion_scores) * head_width


def full_attention(config: Any, max_length: int) -> bool:
    """Does every layer attend to every earlier token of a `max_length`-token row?

    Mistral sets `sliding_window` with no `use_sliding_window` switch; Qwen2 has the switch (off by
    default); newer configs list `layer_types` per layer. A window at least as long as the row is full.
    """
    window = getattr(config, "sliding_window", None)
    if not window or getattr(config, "use_sliding_window", True) is False or window >= max_length:
        return True
    layer_types = getattr(config, "layer_types", None)
    if layer_types:
        return all(kind == "full_attention" for kind in layer_types)
    return False


class PrefixSharedLM:
    """Prompt-once forward, log-probs and sampling over a Hugging Face Llama/Qwen2/Qwen3/Mistral model."""

    def __init__(self, model: Any):
        base = model.get_base_model() if hasattr(model, "get_base_model") else model  # peft: LoRA modules stay in
        self.model = model
        self.decoder = base.model
        self.lm_head = base.lm_head
        config = base.config
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = getattr(config, "num_key_value_heads", None) or self.num_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.num_heads
        self.scaling = self.head_dim ** -0.5
        # Rotate q|k as complex pairs (see the module docstring); switched off by `for_model` if the
        # model's rotary embedding is not the standard one that this reordering reproduces.
        self.complex_rotary = True
        # How the training and reference forwards arrange attention (`_attention_rows`); the self-check runs both.
        self.attention_rows: Literal["auto", "group", "completion"] = "auto"
        # Large float32 products on the CPU go to oneDNN's kernels (`engine/matmul.py`); False: PyTorch's own.
        self.onednn_matmul = True
        # Log-probs of a row that repeats an earlier row's prompt and completion are computed once (`distinct_rows`).
        self.distinct_rows = True
        # Training forwards keep only each decoder layer's input and recompute the layer in backward (`grpo.
        # gradient_checkpointing`): activation memory of one layer instead of all of them, for one more forward.
        self.gradient_checkpointing = False
        self._dropouts = [m for m in model.modules() if isinstance(m, torch.nn.Dropout)]

    @classmethod
    def for_model(cls, model: Any, vocab_size: int | None = None, max_length: int | None = None,
                  completion_length: int | None = None, onednn_matmul: bool = True) -> "PrefixSharedLM | None":
        """A checked instance, or None when the architecture is unsupported or disagrees with Hugging Face.

        `max_length` is the longest row (prompt + completion tokens) it will see; the self-check runs
        rows that long, with `completion_length` completion tokens. Unset: the model's context length.
        Models whose attention is not full over such a row (a sliding window shorter than it, per-layer
        attention types other than full) and models with attention dropout (this forward applies
        none, so it would differ in train mode) get None: the plain Hugging Face forward.
        """
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        config = getattr(base, "config", None)
        if getattr(config, "model_type", None) not in SUPPORTED_MODEL_TYPES:
            return None
        longest = max_length or getattr(config, "max_position_embeddings", None) or 4096
        if not full_attention(config, longest) or float(getattr(config, "attention_dropout", 0.0) or 0.0) > 0:
            return None
        completion = max(2, min(completion_length or 4, longest - 2))
        prompt = max(2, min(longest, MAX_CHECK_LENGTH) - completion)
        fast = cls(model)
        fast.onednn_matmul = onednn_matmul
        if fast.matches_reference_forward(vocab_size or config.vocab_size, prompt, completion):
            return fast
        fast.complex_rotary = False  # e.g. a rotary variant whose halves differ: the plain rotation
        return fast if fast.matches_reference_forward(vocab_size or config.vocab_size, prompt, completion) else None

    def for_same_architecture(self, model: Any) -> "PrefixSharedLM":
        """An instance over another model of this architecture (the frozen reference), with the settings
        this instance's self-check chose, so both rotate queries and keys the same way."""
        twin = type(self)(model)
        twin.complex_rotary, twin.attention_rows = self.complex_rotary, self.attention_rows
        twin.onednn_matmul, twin.distinct_rows = self.onednn_matmul, self.distinct_rows
        twin.gradient_checkpointing = self.gradient_checkpointing
        return twin

    # ----------------------------------------------------------------------------------------- pieces
    def _positions(self, x: torch.Tensor, position_ids: torch.Tensor) -> Rotary:
        cos, sin = self.decoder.rotary_emb(x, position_ids)
        return Rotary(cos.unsqueeze(1), sin.unsqueeze(1))  # broadcast over heads

    def _rotates_as_complex(self, dtype: torch.dtype) -> bool:
        """Complex rotation needs a complex dtype (none for bfloat16) and q|k without per-head norms."""
        return (self.complex_rotary and dtype in (torch.float32, torch.float64)
                and not hasattr(self.decoder.layers[0].self_attn, "q_norm"))

    def fused_weights(self, merge_lora: bool = False) -> list[LayerWeights]:
        """Per layer, each projection as a plain matmul where possible, q|k|v fused into one.

        A projection that is not a plain `nn.Linear` is called as a module, except that with `merge_lora`
        (decoding and reference forwards: no gradient) a LoRA-wrapped one becomes one matmul with
        W + s * B @ A (or W alone while its adapters are disabled): 2 matmuls, a scale and an add fewer
        per projection and decode step, and the q|k|v fusion applies again. Built once per
        forward or decoding run; gradients flow back through the cat. `_qkv` rotates paired rows as
        complex numbers and the others with cos/sin, so the rows' order and the rotation cannot disagree.
        """
        fused = []
        for layer in self.decoder.layers:
            attn, mlp = layer.self_attn, layer.mlp
            q, k, v = (plain_linear(m, merge_lora) for m in (attn.q_proj, attn.k_proj, attn.v_proj))
            qkv = None
            if q is not None and k is not None and v is not None:
                paired = self._rotates_as_complex(q[0].dtype)
                heads = (self.num_heads, self.num_kv_heads) if paired else None
                weight = _fuse_qkv(q[0], k[0], v[0], heads)
                has_bias = q[1] is not None and k[1] is not None and v[1] is not None
                bias = _fuse_qkv(q[1], k[1], v[1], heads) if has_bias else None
                qkv = (weight, bias, paired)
            gate, up = plain_linear(mlp.gate_proj, merge_lora), plain_linear(mlp.up_proj, merge_lora)
            gate_up = None
            if gate is not None and up is not None and gate[1] is None and up[1] is None:
                gate_up = (gate[0], up[0])
            fused.append(LayerWeights(qkv, plain_linear(attn.o_proj, merge_lora), gate_up,
                                      plain_linear(mlp.down_proj, merge_lora)))
        return fused

    def _norm(self, module: Any, x: torch.Tensor) -> torch.Tensor:
        if type(module).__name__.endswith("RMSNorm") and hasattr(module, "variance_epsilon"):
            return rms_norm(x, module.weight, module.variance_epsilon)
        return module(x)

    def _qkv(self, layer: Any, fused: LayerWeights, h: torch.Tensor, rotary: Rotary):
        """Rotated queries [B, H, L, d] and keys, values [B, Hkv, L, d] (views where the projection is fused)."""
        parts = self._qkv_parts(layer, fused, h, rotary)
        if len(parts) == 3:
            return parts
        qk, v = parts
        return qk[:, :self.num_heads], qk[:, self.num_heads:], v

    def _qkv_heads(self, layer: Any, fused: LayerWeights, h: torch.Tensor, rotary: Rotary) -> torch.Tensor:
        """`_qkv` as one tensor [B, H + 2 Hkv, L, d], for callers that split it by token and by head: views whose
        backward is one cat, where slicing three tensors costs a zero-filled gradient per slice."""
        return torch.cat(self._qkv_parts(layer, fused, h, rotary), dim=1)

    def _qkv_parts(self, layer: Any, fused: LayerWeights, h: torch.Tensor, rotary: Rotary) -> list[torch.Tensor]:
        """[rotated q|k, v] from the fused projection, else [q, k, v]; each [B, heads, L, d]."""
        attn = layer.self_attn
        b, length, _ = h.shape
        heads, kv_heads, d = self.num_heads, self.num_kv_heads, self.head_dim
        cos, sin = rotary.cos, rotary.sin
        if fused.qkv is not None and not hasattr(attn, "q_norm"):
            # One matmul for q|k|v and one rotation for q|k together: fewer small ops per layer.
            weight, bias, paired = fused.qkv
            qkv = self._linear(h, weight, bias)
            qk, v = qkv.split([(heads + kv_heads) * d, kv_heads * d], -1)
            if paired:  # rows paired by `fused_weights`: rotate (x_i, x_i+d/2) as one complex number
                pairs = torch.view_as_complex(qk.unflatten(-1, (heads + kv_heads, d // 2, 2))).transpose(1, 2)
                qk = torch.view_as_real(pairs * rotary.turn).flatten(-2)
            else:
                qk = _rope(qk.view(b, length, heads + kv_heads, d).transpose(1, 2), cos, sin)
            return [qk, v.view(b, length, kv_heads, d).transpose(1, 2)]
        if fused.qkv is not None:  # never paired: models with q/k norms rotate with cos/sin
            weight, bias, _ = fused.qkv
            q, k, v = self._linear(h, weight, bias).split([heads * d, kv_heads * d, kv_heads * d], -1)
        else:
            q, k, v = attn.q_proj(h), attn.k_proj(h), attn.v_proj(h)
        q = q.view(b, length, heads, d).transpose(1, 2)
        k = k.view(b, length, kv_heads, d).transpose(1, 2)
        v = v.view(b, length, kv_heads, d).transpose(1, 2)
        if hasattr(attn, "q_norm"):  # Qwen3 normalises queries and keys per head before RoPE
            q, k = attn.q_norm(q), attn.k_norm(k)
        return [_rope(q, cos, sin), _rope(k, cos, sin), v]

    def _linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return matmul_linear(x, weight, bias, onednn=self.onednn_matmul)

    def _merge_heads(self, attn_out: torch.Tensor) -> torch.Tensor:
        """[B, H, L, d] -> [B, L, H * d]."""
        b, _, length, _ = attn_out.shape
        return attn_out.transpose(1, 2).reshape(b, length, self.num_heads * self.head_dim)

    def _finish_layer(self, layer: Any, fused: LayerWeights, x: torch.Tensor, attn_out: torch.Tensor) -> torch.Tensor:
        """Output projection, residual and MLP; `attn_out` is [B, L, H * d] (heads merged)."""
        x = x + (layer.self_attn.o_proj(attn_out) if fused.o is None else self._linear(attn_out, *fused.o))
        h = self._norm(layer.post_attention_layernorm, x)
        mlp = layer.mlp
        if fused.gate_up is not None:
            gate, up = self._linear(h, fused.gate_up[0]), self._linear(h, fused.gate_up[1])
            hidden = mlp.act_fn(gate) * up
            return x + (mlp.down_proj(hidden) if fused.down is None else self._linear(hidden, *fused.down))
        return x + mlp(h)

    @staticmethod
    def _bias(keep: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
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

    def _attend(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        """Grouped-query attention with an additive mask: q [B, H, L, d], keys and values [B, Hkv, K, d], bias
        [B, 1, 1, L, K]; returns [B, H, L, d].

        The H / Hkv query heads that share a key/value head are folded into the query rows ([B, Hkv, rep * L,
        d]), so one batched matmul serves them all: broadcasting [B, Hkv, rep, L, d] against the keys makes
        matmul copy them rep times. Measured on 2 cores, SmolLM2's 3 kv heads x 3: a decode step over 64 cached
        keys 0.72 -> 0.20 ms, over 400 keys 39.9 -> 1.5 ms; forward + backward of 15 completion tokens over 62
        keys 19.8 -> 9.8 ms (as fast as scaled_dot_product_attention, which is 4x slower on the tiny model).
        """
        b, heads, length, d = q.shape
        kv, rep = self.num_kv_heads, heads // self.num_kv_heads
        if length == 1 and keys.shape[2] <= SMALL_DECODE_KEYS:
            # One query over a very short cache: a broadcast multiply-sum beats tiny batched matmuls.
            qg, keys, values = q.view(b, kv, rep, 1, d), keys.unsqueeze(2), values.unsqueeze(2)
            probs = self._softmax(torch.add(bias, (qg * keys).sum(-1).unsqueeze(-2), alpha=self.scaling))
            return (probs.transpose(-1, -2) * values).sum(-2, keepdim=True).flatten(1, 2)
        scores = (q.reshape(b, kv, rep * length, d) @ keys.transpose(-1, -2)).view(b, kv, rep, length, -1)
        # bias + scaling * scores in one operator: the same values as scaling then adding (the mask is 0 or finfo.min)
        probs = self._softmax(torch.add(bias, scores, alpha=self.scaling)).view(b, kv, rep * length, -1)
        return (probs @ values).view(b, heads, length, d)

    # ----------------------------------------------------------------------------------------- prompt
    def encode_prompts(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, weights: list):
        """Run left-padded prompts once: (final-normed hidden state at the last position [U, D], per-layer
        (K, V) caches [U, Hkv, W, d], cache mask [U, W]: which of the W cached positions are real tokens).

        When the prompts share their first `SHARED_PREFIX_MIN` or more real tokens (a system prompt, a chat
        template's header), that prefix is encoded once and each prompt encodes only the rest while
        attending to it; the caches then hold [prefix | padding | rest].
        """
        return self._encode(self._prompt_pass(prompt_ids, prompt_mask, weights), weights)

    def _prompt_pass(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, weights: list) -> _PromptPass:
        """What a layer loop over the prompts needs; a prefix all prompts share is encoded here, once."""
        shared = shared_prefix_length(prompt_ids, prompt_mask)
        prefix = None
        ids, mask = prompt_ids, prompt_mask
        if shared >= SHARED_PREFIX_MIN:
            head = prompt_ids[:1, prompt_ids.shape[1] - int(prompt_mask[0].sum()):][:, :shared]
            prefix = self._encode(self._prompt_pass_of(head, torch.ones_like(head), None), weights)[1]
            rest = prompt_mask.sum(-1) - shared  # real tokens after the prefix, at least 1
            width = int(rest.max())
            ids = prompt_ids[:, -width:]
            mask = (torch.arange(width, device=rest.device) >= width - rest[:, None]).to(prompt_mask.dtype)
        return self._prompt_pass_of(ids, mask, prefix)

    def _prompt_pass_of(self, ids: torch.Tensor, mask: torch.Tensor, prefix: list | None) -> _PromptPass:
        length = ids.shape[1]
        done = 0 if prefix is None else prefix[0][0].shape[2]
        causal = torch.ones(length, length, dtype=torch.bool, device=ids.device).tril()
        keep = causal[None] & mask.bool()[:, None, :]
        if done:
            keep = torch.cat([keep.new_ones(len(ids), length, done), keep], dim=-1)
        cache_mask = mask if not done else torch.cat([mask.new_ones(len(ids), done), mask], dim=1)
        dtype = self.decoder.embed_tokens.weight.dtype
        return _PromptPass(ids, self._bias(keep, dtype)[:, None, None],  # [U, 1, 1, P, done + P]
                           done + (mask.long().cumsum(-1) - 1).clamp(min=0), prefix, cache_mask)

    def _prompt_layer(self, prompts: _PromptPass, i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        """Layer i's attention over the prompts: (output [U, P, H * d], the layer's (K, V) cache with the prefix)."""
        if prompts.prefix is not None:
            kp, vp = prompts.prefix[i]
            k = torch.cat([kp.expand(len(k), -1, -1, -1), k], dim=2)
            v = torch.cat([vp.expand(len(v), -1, -1, -1), v], dim=2)
        return self._merge_heads(self._attend(q, k, v, prompts.bias)), (k, v)

    def _encode(self, prompts: _PromptPass, weights: list):
        """`encode_prompts` for a prepared pass (prompt ids after the shared prefix, if any)."""
        x = self.decoder.embed_tokens(prompts.ids)
        rotary = self._positions(x, prompts.positions)
        caches = []
        for i, (layer, fused) in enumerate(zip(self.decoder.layers, weights)):
            q, k, v = self._qkv(layer, fused, self._norm(layer.input_layernorm, x), rotary)
            attn, cache = self._prompt_layer(prompts, i, q, k, v)
            caches.append(cache)
            x = self._finish_layer(layer, fused, x, attn)
        return self._norm(self.decoder.norm, x[:, -1, :]), caches, prompts.cache_mask

    def _logits(self, hidden: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
        """Vocabulary logits / temperature; a bias-free head takes the division on the (much smaller) hidden state."""
        if temperature == 1.0:
            return self.head(hidden)
        if type(self.lm_head) is torch.nn.Linear and self.lm_head.bias is None:
            return self.head(hidden / temperature)
        return self.head(hidden) / temperature

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        """The vocabulary head: `linear` (oneDNN for large products) for a plain `nn.Linear` without hooks, else
        the module itself (so forward hooks on it still run)."""
        head = self.lm_head
        if type(head) is torch.nn.Linear and not (head._forward_hooks or head._forward_pre_hooks):
            return self._linear(hidden, head.weight, head.bias)
        return head(hidden)

    # ------------------------------------------------------------------------------------- completion
    def _completion_states(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, completion_ids: torch.Tensor,
                           completion_mask: torch.Tensor):
        """Final-normed hidden states that predict the completion tokens, prompt-once and packed.

        Returns (first [N, D]: each row's prompt end, predicting token 0; packed [S, D]: fed token j of
        row r, for each (r, j) in `fed`, predicting token j + 1; fed = (rows, columns)). Only tokens
        that predict a scored token (completion_mask 1 at j + 1) are fed. Projections, norms and MLPs run
        once over one token list (the U x W prompt positions, then the S packed completion tokens); only
        attention arranges them in rows, one of two ways (`_attention_rows`).

        GRPO rollouts keep each group's rows together, so runs of equal prompts are the groups.
        """
        # Equal ids with another mask are another prompt (a real token can equal the pad id).
        keyed = torch.cat([prompt_ids, prompt_mask.to(prompt_ids.dtype)], dim=1)
        unique_keyed, rows, counts = torch.unique_consecutive(keyed, dim=0, return_inverse=True, return_counts=True)
        width = prompt_ids.shape[1]
        unique, unique_mask = unique_keyed[:, :width], unique_keyed[:, width:].to(prompt_mask.dtype)
        weights = self.fused_weights(merge_lora=not torch.is_grad_enabled())  # no gradient: LoRA merged
        prompts = self._prompt_pass(unique, unique_mask, weights)
        steps = completion_ids.shape[1] - 1  # the last token predicts nothing we score
        fed = completion_mask[:, 1:].bool().nonzero(as_tuple=True)
        if steps == 0 or len(fed[0]) == 0:
            last = self._encode(prompts, weights)[0]
            return last.index_select(0, rows), last.new_zeros(0, last.shape[-1]), fed
        fed_rows, fed_cols = fed
        u, w = prompts.ids.shape
        x = self.decoder.embed_tokens(torch.cat([prompts.ids.flatten(), completion_ids[fed_rows, fed_cols]]))[None]
        start = unique_mask.sum(-1)[rows]
        rotary = self._positions(x, torch.cat([prompts.positions.flatten(), start[fed_rows] + fed_cols])[None])
        attend = self._attention_rows(prompts, rows, counts, fed_rows, fed_cols, steps)

        def decoder_layer(x: torch.Tensor, i: int, layer: Any, fused: LayerWeights) -> torch.Tensor:
            heads = self._qkv_heads(layer, fused, self._norm(layer.input_layernorm, x), rotary)[0]  # [h, U*W + S, d]
            return self._finish_layer(layer, fused, x, attend(i, heads)[None])

        recompute = self.gradient_checkpointing and torch.is_grad_enabled()
        for i, (layer, fused) in enumerate(zip(self.decoder.layers, weights)):
            x = (checkpoint(decoder_layer, x, i, layer, fused, use_reentrant=False) if recompute
                 else decoder_layer(x, i, layer, fused))
        # each prompt's last position (predicting token 0), then the packed tokens, through the final norm at once
        hidden = self._norm(self.decoder.norm, torch.cat([x[0, w - 1:u * w:w], x[0, u * w:]]))
        return hidden[:u].index_select(0, rows), hidden[u:], fed

    def _attention_rows(self, prompts: _PromptPass, rows: torch.Tensor, counts: torch.Tensor, fed_rows: torch.Tensor,
                        fed_cols: torch.Tensor, steps: int) -> Callable[[int, torch.Tensor], torch.Tensor]:
        """Layer i's attention over the token list: `attend(i, heads [H + 2 Hkv, U*W + S, d])` -> [U*W + S, H * d].

        Group rows (`_group_rows`): one row per prompt holding its tokens and all its group's completion
        tokens; a quarter fewer operator calls on the tiny default, but each row's scores are a square over prompt + G
        completions. Completion rows (`_completion_rows`): one row per completion over its prompt's cache;
        the least attention work. `attention_rows` "auto" takes group rows while the scores they add stay
        under `GROUP_ROWS_EXTRA_WORK` multiply-adds a layer (never with a shared prefix).
        """
        u, w = prompts.ids.shape
        per_group = torch.bincount(rows[fed_rows], minlength=u)  # packed tokens of each prompt's group
        length = w + int(per_group.max())
        extra = group_rows_extra_work(u, w, length, len(rows), steps, self.num_heads * self.head_dim)
        if prompts.prefix is None and (self.attention_rows == "group"
                                       or self.attention_rows == "auto" and extra <= GROUP_ROWS_EXTRA_WORK):
            return self._group_rows(prompts, rows, per_group, length, fed_rows, fed_cols)
        return self._completion_rows(prompts, rows, counts, fed_rows, fed_cols, steps)

    def _group_rows(self, prompts: _PromptPass, rows: torch.Tensor, per_group: torch.Tensor, length: int,
                    fed_rows: torch.Tensor, fed_cols: torch.Tensor) -> Callable[[int, torch.Tensor], torch.Tensor]:
        """Attention in one row of `length` slots per prompt: its W positions, then its group's packed tokens.

        A key is visible to a query when it comes no later (`order`: prompt position, or W + completion
        column) and is either a real prompt token or a token of the same completion (`owner`). One gather
        puts the token list into the [U, length] grid (empty slots read an appended zero row), one gather
        takes the outputs back.
        """
        u, w = prompts.ids.shape
        device = rows.device
        group_of = rows[fed_rows]
        within = torch.arange(len(fed_rows), device=device) - (per_group.cumsum(0) - per_group)[group_of]
        prompt_slots = (torch.arange(u, device=device)[:, None] * length + torch.arange(w, device=device)).flatten()
        slot = torch.cat([prompt_slots, group_of * length + w + within])  # each listed token's place in the grid
        source = torch.full((u * length,), len(slot), dtype=slot.dtype, device=device)
        source[slot] = torch.arange(len(slot), device=device)
        real = prompts.cache_mask.bool()
        owner = torch.full((u, length), -2, dtype=torch.long, device=device)  # -2: an empty slot
        owner[:, :w] = torch.where(real, -1, -3)  # -1: a real prompt token, -3: left padding
        owner.view(-1)[slot[u * w:]] = fed_rows
        order = torch.full((u, length), length + w, dtype=torch.long, device=device)
        order[:, :w] = torch.arange(w, device=device)
        order.view(-1)[slot[u * w:]] = w + fed_cols
        same_owner = owner[:, None, :] == owner[:, :, None]
        keep = (order[:, None, :] <= order[:, :, None]) & ((owner[:, None, :] == -1) | same_owner)
        bias = self._bias(keep, self.decoder.embed_tokens.weight.dtype)[:, None, None]  # [U, 1, 1, L, L]
        sizes = [self.num_heads, self.num_kv_heads, self.num_kv_heads]

        def attend(_i: int, heads: torch.Tensor) -> torch.Tensor:
            flat = torch.nn.functional.pad(heads.transpose(0, 1), (0, 0, 0, 0, 0, 1))  # [T + 1, h, d]
            q, k, v = flat.index_select(0, source).view(u, length, *flat.shape[1:]).transpose(1, 2).split(sizes, 1)
            return self._merge_heads(self._attend(q, k, v, bias)).flatten(0, 1).index_select(0, slot)

        return attend

    def _completion_rows(self, prompts: _PromptPass, rows: torch.Tensor, counts: torch.Tensor, fed_rows: torch.Tensor,
                         fed_cols: torch.Tensor, steps: int) -> Callable[[int, torch.Tensor], torch.Tensor]:
        """Attention with the prompts as rows of their own and one row per completion over its prompt's cache.

        Completion tokens are padded per row ([N, steps]), where causality keeps real tokens from
        attending to the padding. When every group has the same size G, each prompt's cache reaches its G
        rows by broadcasting (its gradient is a sum over G); otherwise rows gather it with an index (a
        scatter-add backward).
        """
        u, w = prompts.ids.shape
        n, device = len(rows), rows.device
        group = n // max(u, 1)
        even = bool((counts == group).all())
        place = fed_rows * steps + fed_cols  # each packed token's slot in the padded [N, steps] grid
        causal = torch.ones(steps, steps, dtype=torch.bool, device=device).tril()
        keep = torch.cat([prompts.cache_mask.bool()[rows][:, None, :].expand(-1, steps, -1),
                          causal[None].expand(n, -1, -1)], dim=-1)
        bias = self._bias(keep, self.decoder.embed_tokens.weight.dtype)[:, None, None]  # [N, 1, 1, steps, P + steps]
        # each slot of the padded [N, steps] grid: its packed token, or the zero row appended after them
        source = torch.full((n * steps,), len(place), dtype=place.dtype, device=device)
        source[place] = torch.arange(len(place), device=device)
        sizes = [self.num_heads, self.num_kv_heads, self.num_kv_heads]

        def unpack(t: torch.Tensor) -> torch.Tensor:  # [h, S, d] -> [N, h, steps, d], zeros in the padding
            flat = torch.nn.functional.pad(t.transpose(0, 1), (0, 0, 0, 0, 0, 1))  # one pass writes the grid
            return flat.index_select(0, source).view(n, steps, *flat.shape[1:]).transpose(1, 2)

        def attend(i: int, heads: torch.Tensor) -> torch.Tensor:
            prompt_part, packed = heads.split([u * w, heads.shape[1] - u * w], dim=1)
            prompt_attn, (kp, vp) = self._prompt_layer(
                prompts, i, *prompt_part.unflatten(1, (u, w)).transpose(0, 1).split(sizes, dim=1))
            q, k, v = unpack(packed).split(sizes, dim=1)
            if even:  # [U, G, H, P + S, d] -> [N, H, P + S, d]: no gather, no scatter-add in backward
                keys = torch.cat([kp[:, None].expand(-1, group, -1, -1, -1), k.unflatten(0, (-1, group))], 3)
                values = torch.cat([vp[:, None].expand(-1, group, -1, -1, -1), v.unflatten(0, (-1, group))], 3)
                keys, values = keys.flatten(0, 1), values.flatten(0, 1)
            else:
                keys = torch.cat([kp.index_select(0, rows), k], dim=2)
                values = torch.cat([vp.index_select(0, rows), v], dim=2)
            attn = self._merge_heads(self._attend(q, keys, values, bias))  # [N, steps, H * d]
            return torch.cat([prompt_attn.flatten(0, 1), attn.flatten(0, 1).index_select(0, place)])

        return attend

    def completion_logprobs(self, rollout: Any, temperature: float = 1.0,
                            with_entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`rollout.completion_logprobs` computed prompt-once and packed: log-probs [N, T] of the completion
        tokens (and their entropies), which are 0 where `completion_mask` is 0 (the plain path scores those too)."""
        return self.token_logprobs(rollout.prompt_ids, rollout.prompt_mask, rollout.completion_ids,
                                   rollout.completion_mask, temperature, with_entropy)

    def token_logprobs(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, completion_ids: torch.Tensor,
                       completion_mask: torch.Tensor, temperature: float = 1.0,
                       with_entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        distinct = distinct_rows(prompt_ids, prompt_mask, completion_ids, completion_mask) \
            if self.distinct_rows and not self._dropout_active() else None
        if distinct is None:
            return self._token_logprobs(prompt_ids, prompt_mask, completion_ids, completion_mask, temperature,
                                        with_entropy)
        first, inverse = distinct
        logp, entropy = self._token_logprobs(*(t.index_select(0, first) for t in (prompt_ids, prompt_mask,
                                                                                   completion_ids, completion_mask)),
                                             temperature, with_entropy)
        return logp.index_select(0, inverse), None if entropy is None else entropy.index_select(0, inverse)

    def _dropout_active(self) -> bool:
        """Dropout in train mode (LoRA's) would draw other masks for repeated rows: they are then computed apart."""
        return self.model.training and any(m.p > 0 and m.training for m in self._dropouts)

    def _token_logprobs(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, completion_ids: torch.Tensor,
                        completion_mask: torch.Tensor, temperature: float,
                        with_entropy: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        first, packed, (fed_rows, fed_cols) = self._completion_states(prompt_ids, prompt_mask, completion_ids,
                                                                      completion_mask)
        n, width = completion_ids.shape
        logits = lambda hidden: self._logits(hidden, temperature)  # noqa: E731 - computed chunk by chunk
        vocab = getattr(self.lm_head, "out_features", None) or self.decoder.embed_tokens.num_embeddings
        scored = [head_token_logprobs(logits, first, completion_ids[:, 0], vocab, with_entropy)]
        slots = [torch.arange(n, device=completion_ids.device) * width]
        if len(fed_rows):
            scored.append(head_token_logprobs(logits, packed, completion_ids[fed_rows, fed_cols + 1], vocab,
                                              with_entropy))
            slots.append(fed_rows * width + fed_cols + 1)
        place = torch.cat(slots)

        def spread(values: list[torch.Tensor]) -> torch.Tensor:  # packed values -> [N, T], zeros elsewhere
            flat = torch.cat(values)
            return flat.new_zeros(n * width).index_copy(0, place, flat).view(n, width)

        logp = spread([lp for lp, _ in scored])
        return logp, (spread([h for _, h in scored]) if with_entropy else None)

    # --------------------------------------------------------------------------------------- sampling
    def start_decoding(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, group_size: int,
                       max_new_tokens: int) -> "_Decoder":
        """Encode prompts once; the decoder holds G copies of each prompt's cache plus room for the completion."""
        weights = self.fused_weights(merge_lora=not torch.is_grad_enabled())  # no gradient: LoRA merged
        last, caches, cache_mask = self.encode_prompts(prompt_ids, prompt_mask, weights)
        first = self.head(last)
        rows = torch.arange(prompt_ids.shape[0], device=prompt_ids.device).repeat_interleave(group_size)
        buffers = []
        room = min(max_new_tokens, DECODE_CACHE_BLOCK)  # the cache grows as tokens are decoded (`_Decoder.feed`)
        for k, v in caches:  # each prompt's cache copied to its G rows by broadcasting (no gathered copy first)
            u, heads, p_len, d = k.shape
            kbuf, vbuf = (t.new_empty(u, group_size, heads, p_len + room, d) for t in (k, v))
            kbuf[:, :, :, :p_len], vbuf[:, :, :, :p_len] = k[:, None], v[:, None]
            buffers.append((kbuf.flatten(0, 1), vbuf.flatten(0, 1)))
        keep = torch.cat([cache_mask.bool()[rows], torch.ones(len(rows), max_new_tokens, dtype=torch.bool,
                                                               device=prompt_ids.device)], dim=-1)
        bias = self._bias(keep, first.dtype)[:, None, None, None, :]  # [N, 1, 1, 1, P + T]
        start = prompt_mask.sum(-1)[rows]
        positions = start[:, None] + torch.arange(max_new_tokens, device=prompt_ids.device)
        rope = self._positions(first[:, None, :1], positions)  # every decode step's rotation, computed once
        return _Decoder(self, weights, buffers, bias, cache_mask.shape[1], rope, first.index_select(0, rows),
                        cache_mask.shape[1] + max_new_tokens)

    # ------------------------------------------------------------------------------------------ check
    @torch.no_grad()
    def matches_reference_forward(self, vocab_size: int, prompt_length: int = 5, completion_length: int = 4) -> bool:
        """Compare token log-probs and entropies with the Hugging Face forward on small left-padded batches.

        Rows 3 and 4 repeat row 0's prompt ids side by side, row 4 with another mask (a padded token made
        real), so the check fails if prompts that differ only in their mask are merged; row 1 ends early,
        so the packed forward is checked against padding too. When prompts this long can share a prefix
        worth encoding once, a second batch whose prompts share their first tokens checks that path. Both
        attention layouts (`_attention_rows`) are checked, whichever "auto" would take. The entropies depend
        on every logit.
        """
        batches = [self._check_batch(vocab_size, prompt_length, completion_length, shared_head=0)]
        if prompt_length - 3 >= SHARED_PREFIX_MIN:
            head = max(SHARED_PREFIX_MIN, (prompt_length - 2) // 2)
            batches.append(self._check_batch(vocab_size, prompt_length, completion_length, shared_head=head))
        was_training, chosen = self.model.training, self.attention_rows
        self.model.eval()

        def agrees(batch: tuple, attention_rows: str) -> bool:
            self.attention_rows = attention_rows
            return self._agrees_with_hugging_face(*batch)

        try:
            return all(agrees(batch, rows) for batch in batches for rows in ("group", "completion"))
        finally:
            self.model.train(was_training)
            self.attention_rows = chosen

    def _check_batch(self, vocab_size: int, prompt_length: int, completion_length: int, shared_head: int):
        device = next(self.model.parameters()).device
        gen = torch.Generator().manual_seed(0)
        prompt = torch.randint(0, vocab_size, (3, prompt_length), generator=gen)
        mask = torch.ones_like(prompt)
        mask[1, :2] = 0
        mask[0, :1] = 0
        if shared_head:  # rows 1 and 2 start with row 0's first real tokens
            prompt[1, 2:2 + shared_head] = prompt[2, :shared_head] = prompt[0, 1:1 + shared_head]
        completion = torch.randint(0, vocab_size, (3, completion_length), generator=gen)
        prompt = torch.cat([prompt, prompt[:1], prompt[:1]])  # a repeated prompt exercises the shared path
        mask = torch.cat([mask, mask[:1], mask[:1] if shared_head else torch.ones_like(mask[:1])])
        completion = torch.cat([completion, completion[2:3], completion[1:2]])
        completion_mask = torch.ones_like(completion)
        completion_mask[1, max(1, completion_length // 2):] = 0
        return tuple(t.to(device) for t in (prompt, mask, completion, completion_mask))

    def _agrees_with_hugging_face(self, prompt: torch.Tensor, mask: torch.Tensor, completion: torch.Tensor,
                                  completion_mask: torch.Tensor) -> bool:
        checked = Rollout(prompt, mask, completion, completion_mask, torch.zeros(len(completion), dtype=torch.bool))
        ref_logp, ref_entropy = completion_logprobs(self.model, checked, with_entropy=True)  # Hugging Face's forward
        logp, entropy = self.completion_logprobs(checked, with_entropy=True)
        real = completion_mask.bool()
        error = torch.cat([(logp - ref_logp)[real], (entropy - ref_entropy)[real]]).abs()
        tolerance = CHECK_TOLERANCE.get(next(self.model.parameters()).dtype, 0.1)
        return bool(torch.isfinite(error).all()) and float(error.max()) <= tolerance


@dataclass
class _PromptPass:
    """Left-padded prompt ids [U, P] (after a shared prefix, if any) and what attending over them needs."""

    ids: torch.Tensor
    bias: torch.Tensor  # [U, 1, 1, P, prefix + P] additive attention mask
    positions: torch.Tensor  # [U, P] rotary positions (after the prefix)
    prefix: list | None  # per layer (K, V) [1, Hkv, prefix, d] of the prefix all prompts share, or None
    cache_mask: torch.Tensor  # [U, prefix + P]: which cached positions are real tokens


class _Decoder:
    """Incremental decoding state for `PrefixSharedLM.start_decoding`: one token per row per `feed`."""

    def __init__(self, lm: PrefixSharedLM, weights: list, buffers: list, bias: torch.Tensor, prompt_len: int,
                 rope: Rotary, first_logits: torch.Tensor, max_length: int):
        self.lm, self.weights, self.buffers, self.bias, self.prompt_len = lm, weights, buffers, bias, prompt_len
        self.rope, self.logits, self.offset, self.max_length = rope, first_logits, 0, max_length

    def _reserve(self, end: int) -> None:
        """Room in the caches for `end` positions: the completion part doubles (at least `DECODE_CACHE_BLOCK`
        more) when full, so the caches hold about what was decoded rather than `max_new_tokens` from the start."""
        capacity = self.buffers[0][0].shape[2]
        if end <= capacity:
            return
        grown = min(self.max_length, max(end, capacity + max(DECODE_CACHE_BLOCK, capacity - self.prompt_len)))

        def widen(t: torch.Tensor) -> torch.Tensor:
            out = t.new_empty(*t.shape[:2], grown, t.shape[3])
            out[:, :, :capacity] = t
            return out

        self.buffers = [(widen(k), widen(v)) for k, v in self.buffers]

    def keep(self, rows: torch.Tensor) -> None:
        """Decode only `rows` from now on (indices into the rows held now): finished rows cost nothing more.
        Copies each layer's cache once, so the sampler calls it only when enough rows have finished."""
        self.buffers = [(k.index_select(0, rows), v.index_select(0, rows)) for k, v in self.buffers]
        self.bias = self.bias.index_select(0, rows)
        self.rope = Rotary(self.rope.cos.index_select(0, rows), self.rope.sin.index_select(0, rows))
        self.logits = self.logits.index_select(0, rows)

    def feed(self, tokens: torch.Tensor) -> torch.Tensor:
        """Append one token per row held; return the logits [rows, V] for the next one."""
        lm, end = self.lm, self.prompt_len + self.offset + 1
        self._reserve(end)
        x = lm.decoder.embed_tokens(tokens[:, None])
        rotary = self.rope.at(self.offset)
        bias = self.bias[..., :end]
        for layer, fused, (kbuf, vbuf) in zip(lm.decoder.layers, self.weights, self.buffers):
            q, k, v = lm._qkv(layer, fused, lm._norm(layer.input_layernorm, x), rotary)
            kbuf[:, :, end - 1:end], vbuf[:, :, end - 1:end] = k, v
            attn = lm._attend(q, kbuf[:, :, :end], vbuf[:, :, :end], bias)
            x = lm._finish_layer(layer, fused, x, lm._merge_heads(attn))
        self.offset += 1
        self.logits = lm.head(lm._norm(lm.decoder.norm, x[:, 0, :]))
        return self.logits
