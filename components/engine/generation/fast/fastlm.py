"""A lean forward for decoder-only models (the families of `families.py`) that computes each distinct prompt once.

GRPO scores G completions of the same prompt, so a plain forward over `[prompt; completion]` rows
spends most of its work re-encoding the same prompt G times. `PrefixSharedLM` runs the prompt rows
once, keeps their keys/values, and lets every completion row attend to its prompt's cache. Completion
tokens are packed: only the tokens that predict a scored token (up to each row's EOS) go through the
projections, the MLPs and the vocabulary head, so padding after an early EOS costs no matrix work;
attention alone arranges them in rows, padded only to the longest row of a bucket of rows of similar length
(`attention.py`). The last completion token is never fed (its output
predicts nothing we score). Log-probs come from `token_logprobs` (one-pass backward), with the
sampling temperature applied to the hidden state rather than to the vocabulary-sized logits.
Sampling uses the same pieces with a preallocated completion KV cache (`decoder.py`).

It composes the model's own submodules (`pieces.ModelPieces`), so the weights, gradients, optimizer state and LoRA
adapters are the Hugging Face model's. Its options are fixed when it is built; `build.checked_prefix_shared_lm`
builds one that has checked itself against the Hugging Face forward (`check.py`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch.utils.checkpoint import checkpoint

from components.engine.generation.fast.attention import attention_rows
from components.engine.generation.fast.decoder import Decoder, start_decoding
from components.engine.generation.fast.layers import LayerWeights
from components.engine.generation.fast.pieces import FastOptions, ModelPieces
from components.engine.generation.fast.prompts import encode, prompt_pass
from components.engine.generation.fast.rows import distinct_rows
from components.engine.generation.logprobs import head_token_logprobs
from components.engine.generation.rollouts import Turn


class PrefixSharedLM:
    """Prompt-once forward, log-probs and sampling over a Hugging Face model of a family in `families.py`."""

    def __init__(self, model: Any, options: FastOptions = FastOptions()):
        self.model, self.options = model, options
        self.pieces = ModelPieces(model, options)

    def with_options(self, **changes: Any) -> PrefixSharedLM:
        """The same model with some options changed (a new instance: options never change after construction)."""
        return PrefixSharedLM(self.model, dataclasses.replace(self.options, **changes))

    def over(self, model: Any) -> PrefixSharedLM:
        """This forward, with the options its self-check chose, over another model of the same architecture (the
        frozen reference): both then rotate queries and keys alike."""
        return PrefixSharedLM(model, self.options)

    # ------------------------------------------------------------------------------------- completion
    def _completion_states(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, completion_ids: torch.Tensor,
                           completion_mask: torch.Tensor):
        """Final-normed hidden states that predict the completion tokens, prompt-once and packed.

        Returns (first [N, D]: each row's prompt end, predicting token 0; packed [S, D]: fed token j of
        row r, for each (r, j) in `fed`, predicting token j + 1; fed = (rows, columns)). Only tokens
        that predict a scored token (completion_mask 1 at j + 1) are fed. Projections, norms and MLPs run
        once over one token list (the U x W prompt positions, then the S packed completion tokens); only
        attention arranges them in rows, one of two ways (`attention.attention_rows`).

        GRPO rollouts keep each group's rows together, so runs of equal prompts are the groups.
        """
        # Equal ids with another mask are another prompt (a real token can equal the pad id).
        keyed = torch.cat([prompt_ids, prompt_mask.to(prompt_ids.dtype)], dim=1)
        unique_keyed, rows, counts = torch.unique_consecutive(keyed, dim=0, return_inverse=True, return_counts=True)
        width = prompt_ids.shape[1]
        unique, unique_mask = unique_keyed[:, :width], unique_keyed[:, width:].to(prompt_mask.dtype)
        weights = self.pieces.fused_weights(merge_lora=not torch.is_grad_enabled())  # no gradient: LoRA merged
        prompts = prompt_pass(self.pieces, unique, unique_mask, weights)
        steps = completion_ids.shape[1] - 1  # the last token predicts nothing we score
        fed = completion_mask[:, 1:].bool().nonzero(as_tuple=True)
        if steps == 0 or len(fed[0]) == 0:
            last = encode(self.pieces, prompts, weights)[0]
            return last.index_select(0, rows), last.new_zeros(0, last.shape[-1]), fed
        fed_rows, fed_cols = fed
        u, w = prompts.ids.shape
        x = self.pieces.embed(torch.cat([prompts.ids.flatten(), completion_ids[fed_rows, fed_cols]]))[None]
        start = unique_mask.sum(-1)[rows]
        rotary = self.pieces.positions(x, torch.cat([prompts.positions.flatten(), start[fed_rows] + fed_cols])[None])
        attend = attention_rows(self.pieces, prompts, rows, counts, fed_rows, fed_cols, steps)

        def decoder_layer(x: torch.Tensor, i: int, layer: Any, fused: LayerWeights) -> torch.Tensor:
            # heads: [h, U*W + S, d]
            heads = self.pieces.qkv_heads(layer, fused, self.pieces.norm(layer.input_layernorm, x), rotary)[0]
            return self.pieces.finish_layer(layer, fused, x, attend(i, heads)[None])

        recompute = self.options.gradient_checkpointing and torch.is_grad_enabled()
        for i, (layer, fused) in enumerate(zip(self.pieces.layers, weights)):
            x = (checkpoint(decoder_layer, x, i, layer, fused, use_reentrant=False) if recompute
                 else decoder_layer(x, i, layer, fused))
        # each prompt's last position (predicting token 0), then the packed tokens, through the final norm at once
        hidden = self.pieces.final_norm(torch.cat([x[0, w - 1:u * w:w], x[0, u * w:]]))
        return hidden[:u].index_select(0, rows), hidden[u:], fed

    def completion_logprobs(self, rollouts: Turn, temperature: float = 1.0,
                            with_entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`models.logprobs.completion_logprobs` computed prompt-once and packed: log-probs [N, T] of the completion
        tokens (and their entropies), which are 0 where `completion_mask` is 0 (the plain path scores those too)."""
        return self.token_logprobs(rollouts.prompt_ids, rollouts.prompt_mask, rollouts.completion_ids,
                                   rollouts.completion_mask, temperature, with_entropy)

    def token_logprobs(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, completion_ids: torch.Tensor,
                       completion_mask: torch.Tensor, temperature: float = 1.0,
                       with_entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        distinct = distinct_rows(prompt_ids, prompt_mask, completion_ids, completion_mask) \
            if self.options.distinct_rows and not self._dropout_active() else None
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
        return self.model.training and any(m.p > 0 and m.training for m in self.pieces.dropouts)

    def _token_logprobs(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, completion_ids: torch.Tensor,
                        completion_mask: torch.Tensor, temperature: float,
                        with_entropy: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        first, packed, (fed_rows, fed_cols) = self._completion_states(prompt_ids, prompt_mask, completion_ids,
                                                                      completion_mask)
        n, width = completion_ids.shape
        logits = self.pieces.vocab_head(temperature)
        vocab = self.pieces.vocab_size
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
                       max_new_tokens: int, continuing: bool = False) -> Decoder:
        """Encode prompts once; the decoder holds G copies of each prompt's cache (`decoder.start_decoding`)."""
        return start_decoding(self.pieces, prompt_ids, prompt_mask, group_size, max_new_tokens, continuing)
