"""Fixed-shape decoding state for the CUDA-graph engine (`cuda_graphs.py`): tensors allocated once and rewritten in
place, so a captured decode step replays over the same memory run after run.

Everything a decode step reads lives here at a fixed address: the merged decoding weights (`refresh_weights`), a
KV cache of `capacity` rows x `length` positions per layer, the attention mask, each row's rotary table, the token
fed, the completion step `t` and the cache column it writes (both device scalars, so one graph serves every step),
the next logits, which rows are open and where each row's tokens go. A step works on the first `rows` rows (a row
bucket, a power of two) and attends to the first `keys` columns (a multiple of `KEY_BLOCK`); `compact` moves the
rows still open to the front, so the next smaller bucket holds them. Prompts are prefilled by the prompt-once pass
(`fast.prompts.encode_prompts`: each prompt once, its cache copied to its G rows).

Costs: the merged weights are a copy of the projections in the model's dtype (the optimizer updates the model's
own parameters, so each decoding run rewrites the copy: one pass over the weights); the cache holds `capacity x
length` positions of keys and values for every layer, zero-filled so that masked columns stay finite.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch

from components.engine.generation.fast.decoder import gather_columns, packed_columns
from components.engine.generation.fast.layers import LayerTypeRotary, LayerWeights, Rotary
from components.engine.generation.fast.pieces import ModelPieces
from components.engine.generation.fast.prompts import encode_prompts
from components.engine.generation.rollouts import left_pad, positions_from_mask

KEY_BLOCK = 128  # a step attends to its keys rounded up to a multiple of this (one graph per row bucket and block)


@contextlib.contextmanager
def distinct_index_writes() -> Iterator[None]:
    """For writes whose indices are all distinct (a decode step's cache column, each row's output slot): such a write
    has one result on any kernel, so deterministic mode (the grpo stage's setting) is set aside around it. Under it
    CUDA runs `index_copy_` as a sorted `index_put_`, several launches each, 62 writes a SmolLM2 decode step; a
    captured graph keeps whichever kernels ran at capture."""
    if not torch.are_deterministic_algorithms_enabled():
        yield
        return
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(False)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(True, warn_only=warn_only)


def row_bucket(rows: int) -> int:
    """The fixed row count a step over `rows` open rows runs at: the next power of two."""
    return 1 << max(rows - 1, 0).bit_length()


def key_bucket(keys: int, length: int) -> int:
    """The key columns a step that needs `keys` of them attends to: a multiple of `KEY_BLOCK`, at most `length`."""
    return min(length, -(-keys // KEY_BLOCK) * KEY_BLOCK)


def _owned(t: torch.Tensor | None, shared: set[int]) -> torch.Tensor | None:
    return t.clone() if t is not None and t.data_ptr() in shared else t


def _tensors(weights: list[LayerWeights]) -> list[torch.Tensor | None]:
    """Every tensor of the layers' decoding weights, in a fixed order (None where a projection has no bias)."""
    out: list[torch.Tensor | None] = []
    for w in weights:
        out += [w.qkv[0], w.qkv[1], w.o[0], w.o[1], w.gate_up[0], w.gate_up[1], w.down[0], w.down[1]]
    return out


class StaticState:
    """The buffers one engine decodes in, for up to `capacity` rows and `length` cache positions (prompt + completion).

    `weights` are the decoding weights the steps read; `refresh_weights` rewrites them in place from the model
    (LoRA merged, adapters on or off as the model is now) and says whether they still sit where the captured
    graphs read them (False: the caller must capture again).
    """

    def __init__(self, pieces: ModelPieces, capacity: int, length: int, max_new_tokens: int, vocab: int,
                 device: torch.device):
        self.pieces, self.capacity, self.length, self.max_new_tokens = pieces, capacity, length, max_new_tokens
        self.weights = self._fresh_weights(own=True)
        dtype = pieces.dtype
        kv, d = pieces.num_kv_heads, pieces.head_dim
        self.caches = [(torch.zeros(capacity, kv, length, d, dtype=dtype, device=device),
                        torch.zeros(capacity, kv, length, d, dtype=dtype, device=device)) for _ in pieces.layers]
        self.bias = torch.full((capacity, 1, 1, 1, length), torch.finfo(dtype).min, dtype=dtype, device=device)
        # each row's rotary table for its completion steps: one, or one per attention type (`Family`: Gemma 3)
        kinds = sorted(set(pieces.decoder.config.layer_types)) if pieces.family.rotary_per_layer_type else [None]
        self.cos = {kind: torch.zeros(capacity, 1, max_new_tokens, d, dtype=dtype, device=device) for kind in kinds}
        self.sin = {kind: torch.zeros_like(table) for kind, table in self.cos.items()}
        self.tokens = torch.zeros(capacity, dtype=torch.long, device=device)  # the token each row is fed next
        self.step = torch.zeros(1, dtype=torch.long, device=device)  # t: the completion token drawn next
        self.column = torch.zeros(1, dtype=torch.long, device=device)  # the cache column token t is written to
        self.logits = torch.zeros(capacity, vocab, dtype=dtype, device=device)  # each row's next-token logits
        self.open = torch.zeros(capacity, dtype=torch.bool, device=device)
        self.row_of = torch.zeros(capacity, dtype=torch.long, device=device)  # each slot's row in the outputs
        self.out_tokens = torch.zeros((capacity + 1) * max_new_tokens, dtype=torch.long, device=device)
        self.out_logp = torch.zeros((capacity + 1) * max_new_tokens, dtype=torch.float32, device=device)
        self.context = torch.zeros(capacity, length, dtype=torch.bool, device=device)  # real columns before a turn
        self.turn_start = 0  # the column a turn's first token is written to

    # ------------------------------------------------------------------------------------------- weights
    def _fresh_weights(self, own: bool = False) -> list[LayerWeights]:
        """The model's decoding weights now; with `own`, a frozen base weight of a LoRA module is copied (the buffer
        is later rewritten with merged weights, which must never land in the model's own parameter)."""
        weights = self.pieces.fused_weights(merge_lora=True)
        if any(w.qkv is None or w.o is None or w.gate_up is None or w.down is None for w in weights):
            raise ValueError("a projection is not a plain matmul (LoRA with dropout or a variant such as DoRA): "
                             "a captured step cannot call modules")
        if any(w.qkv[2] for w in weights):  # complex pairs need a complex dtype: the step rotates with cos/sin
            raise ValueError("the decoding weights pair q|k rows for a complex rotation; build with complex_rotary off")
        if own:
            bases = {t.data_ptr() for m in self.pieces.model.modules() if hasattr(m, "base_layer")
                     for t in (m.base_layer.weight, getattr(m.base_layer, "bias", None)) if t is not None}
            for w in weights:
                w.o, w.down = (tuple(_owned(t, bases) for t in w.o), tuple(_owned(t, bases) for t in w.down))
                w.gate_up = tuple(_owned(t, bases) for t in w.gate_up)
        return weights

    def refresh_weights(self) -> bool:
        """Rewrite the decoding weights from the model as it is now (in place); False when a tensor the steps read
        is no longer where it was (a parameter replaced, not updated in place): the weights are then rebuilt."""
        fresh = self._fresh_weights()
        mine, theirs = _tensors(self.weights), _tensors(fresh)
        if any((a is None) != (b is None) or (a is not None and a.shape != b.shape) for a, b in zip(mine, theirs)):
            self.weights = self._fresh_weights(own=True)
            return False
        for a, b in zip(mine, theirs):
            if a is not None and a.data_ptr() != b.data_ptr():
                a.copy_(b)
        return True

    # ------------------------------------------------------------------------------------------- a run
    def start(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, group_size: int) -> int:
        """Prefill the prompts once each and lay their caches out over their G rows; returns the rows n (every one
        open, in prompt-major order). The next step draws completion token 0 from `logits`."""
        pieces, n = self.pieces, prompt_ids.shape[0] * group_size
        last, caches, cache_mask = encode_prompts(pieces, prompt_ids, prompt_mask, self.weights)
        width = cache_mask.shape[1]
        if n > self.capacity or width + self.max_new_tokens > self.length:
            raise ValueError(f"{n} rows of {width} + {self.max_new_tokens} positions do not fit {self.capacity} x "
                             f"{self.length}")
        rows = torch.arange(prompt_ids.shape[0], device=prompt_ids.device).repeat_interleave(group_size)
        for (kbuf, vbuf), (k, v) in zip(self.caches, caches):
            kbuf[:n, :, :width].copy_(k.index_select(0, rows))
            vbuf[:n, :, :width].copy_(v.index_select(0, rows))
        low = torch.finfo(self.bias.dtype).min
        self.bias.fill_(low)
        self.bias[:n, ..., :width].masked_fill_(cache_mask.bool()[rows][:, None, None, None, :], 0.0)
        self.context.zero_()
        self.context[:n, :width] = cache_mask.bool()[rows]
        self._begin_turn(n, width, pieces.head(last).index_select(0, rows), last)
        return n

    def _begin_turn(self, n: int, column: int, logits: torch.Tensor, hidden: torch.Tensor) -> None:
        """Rows 0..n-1 open, their next tokens drawn from `logits`, the first written to `column`; each row's positions
        follow its real tokens (`context`). `hidden` only gives the rotary embedding its dtype and device."""
        device = logits.device
        positions = self.context[:n].sum(-1)[:, None] + torch.arange(self.max_new_tokens, device=device)
        rotary = self.pieces.positions(hidden[:1, None, :], positions)
        for kind, table in (rotary.tables if isinstance(rotary, LayerTypeRotary) else {None: rotary}).items():
            self.cos[kind][:n].copy_(table.cos)
            self.sin[kind][:n].copy_(table.sin)
        self.logits.zero_()
        self.logits[:n].copy_(logits)
        self.step.zero_()
        self.column.fill_(column)
        self.turn_start = column
        self.open.zero_()
        self.open[:n] = True
        self.row_of.fill_(self.capacity)  # slots past n write to the spare row of the outputs
        self.row_of[:n] = torch.arange(n, device=device)
        self.tokens.zero_()
        self.out_tokens.zero_()
        self.out_logp.zero_()

    def extend(self, keep: torch.Tensor, fed: torch.Tensor, chunks: Sequence[Sequence[int]], room: int) -> int:
        """After a turn without compaction (slot i holds row i): keep the slots `keep` (ascending; moved to the
        front), each of which fed `fed[i]` real tokens since the turn began (the rest of its turn's columns are
        padding; the kept rows' real columns are packed to the right: `fast.decoder.packed_columns`); feed `chunks[i]`
        to kept row i over its cache in one forward and begin the next turn, of `room` tokens at most. Returns the
        rows kept."""
        pieces, m, column = self.pieces, len(keep), int(self.column)
        turn = torch.arange(column - self.turn_start, device=keep.device)
        real = self.context.index_select(0, keep)[:, :column]
        real[:, self.turn_start:] = turn[None, :] < fed[:, None]
        packed = packed_columns(real)  # each kept row's real columns, packed to the right
        real, column = real.gather(1, packed), packed.shape[1]
        for kbuf, vbuf in self.caches:
            kbuf[:m, :, :column] = gather_columns(kbuf.index_select(0, keep), packed)
            vbuf[:m, :, :column] = gather_columns(vbuf.index_select(0, keep), packed)
        ids, mask = left_pad(chunks, 0, keep.device)
        width = ids.shape[1]
        if column + width + room > self.length or room > self.max_new_tokens:
            raise ValueError(f"{column + width} columns and a turn of {room} tokens do not fit {self.length} columns "
                             f"and turns of {self.max_new_tokens}")
        x = pieces.embed(ids)
        rotary = pieces.positions(x, real.sum(-1, keepdim=True) + positions_from_mask(mask))
        causal = torch.ones(width, width, dtype=torch.bool, device=keep.device).tril()
        visible = torch.cat([real[:, None, :].expand(-1, width, -1), causal[None] & mask.bool()[:, None, :]], -1)
        bias = pieces.bias(visible, x.dtype)[:, None, None]  # [m, 1, 1, W, column + W]
        for layer, fused, (kbuf, vbuf) in zip(pieces.layers, self.weights, self.caches):
            q, k, v = pieces.qkv(layer, fused, pieces.norm(layer.input_layernorm, x), rotary)
            kbuf[:m, :, column:column + width] = k
            vbuf[:m, :, column:column + width] = v
            x = pieces.finish_layer(layer, fused, x, pieces.merge_heads(
                pieces.attend(q, kbuf[:m, :, :column + width], vbuf[:m, :, :column + width], bias)))
        self.context.zero_()
        self.context[:m, :column + width] = torch.cat([real, mask.bool()], 1)
        self.bias.fill_(torch.finfo(self.bias.dtype).min)
        self.bias[:m, 0, 0, 0, :column + width].masked_fill_(self.context[:m, :column + width], 0.0)
        hidden = pieces.final_norm(x[:, -1, :])
        self._begin_turn(m, column + width, pieces.head(hidden), hidden)
        return m

    def forward(self, rows: int, keys: int) -> torch.Tensor:
        """Feed `tokens[:rows]` at completion step `step` (cache column `column`), attending to the first `keys`
        columns; returns the next logits [rows, V] and moves `step` and `column` on by one. Fixed shapes and no host
        synchronisation: the same call is captured as a graph and replayed."""
        pieces = self.pieces
        self.bias[:, ..., :keys].index_fill_(4, self.column, 0.0)  # token t becomes visible to every row
        x = pieces.embed(self.tokens[:rows, None])
        tables = {kind: Rotary(self.cos[kind][:rows].index_select(2, self.step),
                               self.sin[kind][:rows].index_select(2, self.step)) for kind in self.cos}
        rotary = tables[None] if None in tables else LayerTypeRotary(tables)
        bias = self.bias[:rows, ..., :keys]
        for layer, fused, (kbuf, vbuf) in zip(pieces.layers, self.weights, self.caches):
            q, k, v = pieces.qkv(layer, fused, pieces.norm(layer.input_layernorm, x), rotary)
            with distinct_index_writes():
                kbuf[:rows].index_copy_(2, self.column, k)
                vbuf[:rows].index_copy_(2, self.column, v)
            attn = attend(pieces, q, kbuf[:rows, :, :keys], vbuf[:rows, :, :keys], bias)
            x = pieces.finish_layer(layer, fused, x, pieces.merge_heads(attn))
        self.step.add_(1)
        self.column.add_(1)
        return pieces.head(pieces.final_norm(x[:, 0, :]))

    def compact(self, keep: torch.Tensor) -> None:
        """Move the slots `keep` (ascending) to the front, in order: the finished rows' caches are dropped."""
        m = len(keep)
        for kbuf, vbuf in self.caches:
            kbuf[:m] = kbuf.index_select(0, keep)
            vbuf[:m] = vbuf.index_select(0, keep)
        for t in (self.bias, *self.cos.values(), *self.sin.values(), self.tokens, self.logits, self.open, self.row_of):
            t[:m] = t.index_select(0, keep)
        self.open[m:] = False
        self.row_of[m:] = self.capacity

    def outputs(self, n: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The drawn tokens and their sampler log-probs [n, width] of the rows started (`start`)."""
        tokens = self.out_tokens.view(self.capacity + 1, self.max_new_tokens)[:n, :width]
        logp = self.out_logp.view(self.capacity + 1, self.max_new_tokens)[:n, :width]
        return tokens, logp


def attend(pieces: ModelPieces, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
           bias: torch.Tensor) -> torch.Tensor:
    """One query per row over its cache: q [B, H, 1, d], keys and values [B, Hkv, K, d], bias [B, 1, 1, 1, K].

    In half precision the H / Hkv query heads that share a key/value head become the query rows of one fused
    attention call over that head ([B, Hkv, H / Hkv, d]): no copy of the cache per query head (what grouped-query
    attention through `enable_gqa` costs on kernels without it), sums in float32. Otherwise `pieces.attend`.

    The fused call's output is read by `reshape`, never `view`: CUDA's memory-efficient and cuDNN kernels return it
    in a transposed layout ([B, H / Hkv, Hkv, d] in memory), which no view can merge into [B, H, 1, d].
    """
    if q.dtype in (torch.float32, torch.float64) or pieces.attention_softcap:  # soft-capped scores: plain products
        return pieces.attend(q, keys, values, bias)
    b, heads, _, d = q.shape
    kv = keys.shape[1]
    out = torch.nn.functional.scaled_dot_product_attention(q.reshape(b, kv, heads // kv, d), keys, values,
                                                           attn_mask=bias[:, :, 0], scale=pieces.scaling)
    return out.reshape(b, heads, 1, d)
