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

from typing import Any, Literal

import torch
from torch.utils.checkpoint import checkpoint

from components.engine.fast import check
from components.engine.fast.attention import PromptPass, attention_rows
from components.engine.fast.decoder import Decoder, start_decoding
from components.engine.fast.layers import LayerWeights, Rotary, fuse_qkv, plain_linear, rope
from components.engine.fast.matmul import linear as matmul_linear
from components.engine.fast.rmsnorm import rms_norm
from components.engine.fast.rows import SHARED_PREFIX_MIN, distinct_rows, full_attention, shared_prefix_length
from components.engine.models.logprobs import head_token_logprobs

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "mistral")
# On the CPU, softmax over fewer values than this is far slower per row (docs/performance.md): rows are padded.
SOFTMAX_MIN_WIDTH = 16
SMALL_DECODE_KEYS = 16  # up to this many cached keys, decoding attention is a broadcast multiply-sum (measured)



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
        # Large float32 products on the CPU go to oneDNN's kernels (`engine/fast/matmul.py`); False: PyTorch's own.
        self.onednn_matmul = True
        # Log-probs of a row that repeats an earlier row's prompt and completion are computed once (`distinct_rows`).
        self.distinct_rows = True
        # Training forwards keep only each decoder layer's input and recompute the layer in backward (`grpo.
        # gradient_checkpointing`): activation memory of one layer instead of all of them, for one more forward.
        self.gradient_checkpointing = False
        self._dropouts = [m for m in model.modules() if isinstance(m, torch.nn.Dropout)]

    @classmethod
    def for_model(cls, model: Any, vocab_size: int | None = None, max_length: int | None = None,
                  completion_length: int | None = None, onednn_matmul: bool = True) -> PrefixSharedLM | None:
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
        prompt = max(2, min(longest, check.MAX_CHECK_LENGTH) - completion)
        fast = cls(model)
        fast.onednn_matmul = onednn_matmul
        vocab = vocab_size or config.vocab_size
        if not fast.matches_reference_forward(vocab, prompt, completion):
            fast.complex_rotary = False  # e.g. a rotary variant whose halves differ: the plain rotation
            if not fast.matches_reference_forward(vocab, prompt, completion):
                return None
        return fast if fast.trains_like_reference_forward(vocab) else None

    def for_same_architecture(self, model: Any) -> PrefixSharedLM:
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
                qk = rope(qk.view(b, length, heads + kv_heads, d).transpose(1, 2), cos, sin)
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
        return [rope(q, cos, sin), rope(k, cos, sin), v]

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
        d]), so one batched matmul serves them all: broadcasting [B, Hkv, rep, L, d] against the keys would make
        matmul copy them rep times (docs/performance.md has what that cost).
        """
        b, heads, length, d = q.shape
        kv, rep = self.num_kv_heads, heads // self.num_kv_heads
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

    # ----------------------------------------------------------------------------------------- prompt
    def encode_prompts(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, weights: list):
        """Run left-padded prompts once: (final-normed hidden state at the last position [U, D], per-layer
        (K, V) caches [U, Hkv, W, d], cache mask [U, W]: which of the W cached positions are real tokens).

        When the prompts share their first `SHARED_PREFIX_MIN` or more real tokens (a system prompt, a chat
        template's header), that prefix is encoded once and each prompt encodes only the rest while
        attending to it; the caches then hold [prefix | padding | rest].
        """
        return self._encode(self._prompt_pass(prompt_ids, prompt_mask, weights), weights)

    def _prompt_pass(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, weights: list) -> PromptPass:
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

    def _prompt_pass_of(self, ids: torch.Tensor, mask: torch.Tensor, prefix: list | None) -> PromptPass:
        length = ids.shape[1]
        done = 0 if prefix is None else prefix[0][0].shape[2]
        causal = torch.ones(length, length, dtype=torch.bool, device=ids.device).tril()
        keep = causal[None] & mask.bool()[:, None, :]
        if done:
            keep = torch.cat([keep.new_ones(len(ids), length, done), keep], dim=-1)
        cache_mask = mask if not done else torch.cat([mask.new_ones(len(ids), done), mask], dim=1)
        dtype = self.decoder.embed_tokens.weight.dtype
        return PromptPass(ids, self._bias(keep, dtype)[:, None, None],  # [U, 1, 1, P, done + P]
                           done + (mask.long().cumsum(-1) - 1).clamp(min=0), prefix, cache_mask)

    def _prompt_layer(self, prompts: PromptPass, i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        """Layer i's attention over the prompts: (output [U, P, H * d], the layer's (K, V) cache with the prefix)."""
        if prompts.prefix is not None:
            kp, vp = prompts.prefix[i]
            k = torch.cat([kp.expand(len(k), -1, -1, -1), k], dim=2)
            v = torch.cat([vp.expand(len(v), -1, -1, -1), v], dim=2)
        return self._merge_heads(self._attend(q, k, v, prompts.bias)), (k, v)

    def _encode(self, prompts: PromptPass, weights: list):
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
        attend = attention_rows(self, prompts, rows, counts, fed_rows, fed_cols, steps)

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
        logits = lambda hidden: self._logits(hidden, temperature)
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
                       max_new_tokens: int) -> Decoder:
        """Encode prompts once; the decoder holds G copies of each prompt's cache (`decoder.start_decoding`)."""
        return start_decoding(self, prompt_ids, prompt_mask, group_size, max_new_tokens)

    # ------------------------------------------------------------------------------------------ check
    def matches_reference_forward(self, vocab_size: int, prompt_length: int = 5, completion_length: int = 4) -> bool:
        """Log-probs and entropies agree with the Hugging Face forward's (`check.matches_reference_forward`)."""
        return check.matches_reference_forward(self, vocab_size, prompt_length, completion_length)

    def trains_like_reference_forward(self, vocab_size: int) -> bool:
        """Training-mode gradients agree with the Hugging Face forward's (`check.trains_like_reference_forward`)."""
        return check.trains_like_reference_forward(self, vocab_size)
