"""The fast path's decoder: each prompt encoded once, its cache copied to its G rows, one token per open row a step
over a KV cache that grows as tokens are decoded; rows that emitted EOS leave the caches once enough of them have
(`COMPACT_AT`), so the sampler only ever sees the rows still open.

A continuing decoder (an episode's turns) keeps every row until the turn ends (a finished row is fed padding, masked
out of later turns); `extend` then appends each kept row's next tokens (a tool's or environment's answer) to its
cache in one forward, so a conversation is encoded once."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from components.engine.generation.fast.layers import LayerWeights, Rotary
from components.engine.generation.fast.pieces import ModelPieces
from components.engine.generation.fast.prompts import Caches, encode_prompts
from components.engine.generation.rollouts import left_pad, positions_from_mask

DECODE_CACHE_BLOCK = 32  # decoding caches start with room for this many completion tokens and double when full
COMPACT_AT = 0.75  # finished rows leave the caches once at most this share of the rows held is open


def packed_columns(real: torch.Tensor) -> torch.Tensor:
    """A gather index [R, W] over cache columns that packs each row's real tokens (`real` [R, C]: True where a column
    holds one) to the right, in order, W the most any row holds. Attention finds cached keys by mask and their rotary
    positions were applied when they were written, so a packed cache attends as the unpacked one did; rows that fed
    padding while others decoded stop costing columns in every later turn."""
    width = int(real.sum(-1).max()) if len(real) else 0
    order = torch.sort(real.to(torch.int8), dim=-1, stable=True).indices  # padding columns first, real ones in order
    return order[:, real.shape[1] - width:]


def gather_columns(cache: torch.Tensor, columns: torch.Tensor) -> torch.Tensor:
    """`cache` [R, H, C, d] at `columns` [R, W] -> [R, H, W, d]."""
    return cache.gather(2, columns[:, None, :, None].expand(-1, cache.shape[1], -1, cache.shape[3]))


def start_decoding(pieces: ModelPieces, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, group_size: int,
                   max_new_tokens: int, continuing: bool = False) -> Decoder:
    """Encode prompts once; the decoder holds G copies of each prompt's cache plus room for the completion.
    `continuing`: later turns may follow (rows are held to the end of each turn)."""
    weights = pieces.fused_weights(merge_lora=not torch.is_grad_enabled())  # no gradient: LoRA merged
    last, caches, cache_mask = encode_prompts(pieces, prompt_ids, prompt_mask, weights)
    first = pieces.head(last)
    rows = torch.arange(prompt_ids.shape[0], device=prompt_ids.device).repeat_interleave(group_size)
    buffers = []
    room = min(max_new_tokens, DECODE_CACHE_BLOCK)  # the cache grows as tokens are decoded (`Decoder.feed`)
    for k, v in caches:  # each prompt's cache copied to its G rows by broadcasting (no gathered copy first)
        u, heads, p_len, d = k.shape
        kbuf, vbuf = (t.new_empty(u, group_size, heads, p_len + room, d) for t in (k, v))
        kbuf[:, :, :, :p_len], vbuf[:, :, :, :p_len] = k[:, None], v[:, None]
        buffers.append((kbuf.flatten(0, 1), vbuf.flatten(0, 1)))
    keep = torch.cat([cache_mask.bool()[rows], torch.ones(len(rows), max_new_tokens, dtype=torch.bool,
                                                           device=prompt_ids.device)], dim=-1)
    bias = pieces.bias(keep, first.dtype)[:, None, None, None, :]  # [N, 1, 1, 1, P + T]
    start = prompt_mask.sum(-1)[rows]
    positions = start[:, None] + torch.arange(max_new_tokens, device=prompt_ids.device)
    rope = pieces.positions(first[:, None, :1], positions)  # every decode step's rotation, computed once
    decoder = Decoder(pieces, weights, buffers, bias, cache_mask.shape[1], rope, first.index_select(0, rows),
                      cache_mask.shape[1] + max_new_tokens)
    if continuing:
        decoder.real = [cache_mask.bool()[rows]]
    return decoder


class Decoder:
    """Incremental decoding state for `start_decoding`: a step decoder's `logits` and `advance` (the token loop of
    engine/generation/engines/token_loop.py), over `feed` (one token per row held) and `keep` (drop rows from the
    caches)."""

    def __init__(self, pieces: ModelPieces, weights: list[LayerWeights], buffers: Caches, bias: torch.Tensor,
                 prompt_len: int, rope: Rotary, first_logits: torch.Tensor, max_length: int):
        self.pieces, self.weights, self.buffers, self.bias, self.prompt_len = pieces, weights, buffers, bias, prompt_len
        self.rope, self.logits, self.offset, self.max_length = rope, first_logits, 0, max_length
        rows = torch.arange(len(first_logits), device=first_logits.device)
        self.held = rows  # the rows whose caches it holds (indices into the rows it started with)
        self.open = rows  # the rows still decoding, a subset of `held`; `advance` returns their logits
        self.real: list[torch.Tensor] | None = None  # continuing: which cache columns of each row are real tokens

    def advance(self, drawn: torch.Tensor, still_open: torch.Tensor, pad_id: int) -> torch.Tensor:
        """Feed the tokens just drawn for the open rows (`still_open`: which of them did not emit EOS) and return
        the logits of the rows still open. Rows that finished are fed `pad_id` while their caches are held; once at
        most `COMPACT_AT` of the held rows are open, the finished ones leave the caches (one copy per layer)."""
        now_open = self.open[still_open]
        if self.real is not None:  # continuing: every row held to the turn's end; the rows fed a token they drew
            self.real.append(torch.zeros(len(self.held), 1, dtype=torch.bool, device=drawn.device)
                             .index_fill_(0, self.open, True))
        elif len(now_open) <= COMPACT_AT * len(self.held):
            self.keep(torch.searchsorted(self.held, now_open))
            self.held, self.open = now_open, now_open
            return self.feed(drawn[still_open])
        tokens = drawn if len(self.open) == len(self.held) else \
            torch.full((len(self.held),), pad_id, dtype=drawn.dtype, device=drawn.device).index_put_(
                (torch.searchsorted(self.held, self.open),), drawn)
        self.open = now_open
        logits = self.feed(tokens)
        return logits if len(now_open) == len(self.held) else logits[torch.searchsorted(self.held, now_open)]

    def extend(self, rows: torch.Tensor, chunks: Sequence[Sequence[int]], room: int) -> None:
        """Keep `rows` (of a continuing decoder, after a turn), feed each its chunk (left-padded to the longest) over
        its cache in one forward, and start the next turn with room for `room` tokens: the state `start_decoding`
        leaves, with the whole conversation so far as the prompt."""
        pieces = self.pieces
        real = torch.cat(self.real, 1).index_select(0, rows)
        columns = packed_columns(real)
        real, end = real.gather(1, columns), columns.shape[1]
        ids, mask = left_pad(chunks, 0, rows.device)
        width = ids.shape[1]
        capacity = end + width + min(room, DECODE_CACHE_BLOCK)
        buffers = []
        for k, v in self.buffers:
            kbuf, vbuf = (t.new_empty(len(rows), t.shape[1], capacity, t.shape[3]) for t in (k, v))
            kbuf[:, :, :end] = gather_columns(k.index_select(0, rows), columns)
            vbuf[:, :, :end] = gather_columns(v.index_select(0, rows), columns)
            buffers.append((kbuf, vbuf))
        x = pieces.embed(ids)
        rotary = pieces.positions(x, real.sum(-1, keepdim=True) + positions_from_mask(mask))
        causal = torch.ones(width, width, dtype=torch.bool, device=rows.device).tril()
        keep = torch.cat([real[:, None, :].expand(-1, width, -1), causal[None] & mask.bool()[:, None, :]], -1)
        bias = pieces.bias(keep, x.dtype)[:, None, None]  # [R, 1, 1, W, end + W]
        for layer, fused, (kbuf, vbuf) in zip(pieces.layers, self.weights, buffers):
            q, k, v = pieces.qkv(layer, fused, pieces.norm(layer.input_layernorm, x), rotary)
            kbuf[:, :, end:end + width], vbuf[:, :, end:end + width] = k, v
            attn = pieces.attend(q, kbuf[:, :, :end + width], vbuf[:, :, :end + width], bias)
            x = pieces.finish_layer(layer, fused, x, pieces.merge_heads(attn))
        real = torch.cat([real, mask.bool()], 1)
        self.buffers, self.real, self.prompt_len, self.offset = buffers, [real], end + width, 0
        self.logits = pieces.head(pieces.final_norm(x[:, -1, :]))
        self.bias = pieces.bias(torch.cat([real, real.new_ones(len(rows), room)], 1), x.dtype)[:, None, None, None]
        positions = real.sum(-1, keepdim=True) + torch.arange(room, device=rows.device)
        self.rope = pieces.positions(x[:, -1:, :], positions)
        self.held = self.open = torch.arange(len(rows), device=rows.device)
        self.max_length = self.prompt_len + room

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
        self.rope = self.rope.select(rows)
        self.logits = self.logits.index_select(0, rows)

    def feed(self, tokens: torch.Tensor) -> torch.Tensor:
        """Append one token per row held; return the logits [rows, V] for the next one."""
        pieces, end = self.pieces, self.prompt_len + self.offset + 1
        self._reserve(end)
        x = pieces.embed(tokens[:, None])
        rotary = self.rope.at(self.offset)
        bias = self.bias[..., :end]
        for layer, fused, (kbuf, vbuf) in zip(pieces.layers, self.weights, self.buffers):
            q, k, v = pieces.qkv(layer, fused, pieces.norm(layer.input_layernorm, x), rotary)
            kbuf[:, :, end - 1:end], vbuf[:, :, end - 1:end] = k, v
            attn = pieces.attend(q, kbuf[:, :, :end], vbuf[:, :, :end], bias)
            x = pieces.finish_layer(layer, fused, x, pieces.merge_heads(attn))
        self.offset += 1
        self.logits = pieces.head(pieces.final_norm(x[:, 0, :]))
        return self.logits
