"""The token loop the host-driven engines share: draw a token for every open row, stop a row at EOS, stop when all
rows have (or at the budget). A `StepDecoder` holds the model state and gives the open rows' next logits."""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch

from components.engine.generation.engines.base import SamplingParams, SpecialTokens
from components.engine.generation.engines.draw import draw
from components.engine.generation.rollouts import Turn


class StepDecoder(Protocol):
    """One decoding run's state after the prompts were encoded: `logits` of the rows still open; `advance` feeds
    the tokens just drawn for them and returns the logits of those still open (`still_open`: which of the drawn
    tokens were not EOS). How finished rows are held (fed padding, or dropped from the caches) is its own affair."""

    logits: torch.Tensor

    def advance(self, drawn: torch.Tensor, still_open: torch.Tensor, pad_id: int) -> torch.Tensor: ...


def decode(decoder: StepDecoder, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, params: SamplingParams,
           tokens: SpecialTokens, generator: torch.Generator | None,
           stop_together: Callable[[bool], bool] | None = None) -> Turn:
    """`params.n` completions of each left-padded prompt ([B, P]) from `decoder`, prompt-major.

    Only rows that have not emitted EOS draw a token, so every decoder consumes the generator alike.
    `stop_together(all_done_here)` -> all done everywhere: with a sharded (FSDP) model every process must make
    the same forward calls, so decoding stops at EOS only when all processes are done.
    """
    group_size, max_new_tokens = params.n, params.max_new_tokens
    eos_id = -1 if params.ignore_eos else tokens.eos_id  # -1: no token ends a row
    if group_size > 1:
        prompt_ids = prompt_ids.repeat_interleave(group_size, dim=0)
        prompt_mask = prompt_mask.repeat_interleave(group_size, dim=0)
    n, device = prompt_ids.shape[0], prompt_ids.device
    drawn_tokens = torch.full((n, max_new_tokens), tokens.pad_id, dtype=torch.long, device=device)
    sampling_logp = None if params.greedy else torch.zeros((n, max_new_tokens), dtype=torch.float32, device=device)
    open_rows, logits, length = torch.arange(n, device=device), decoder.logits, 0
    for t in range(max_new_tokens):
        if params.greedy:
            drawn = logits.argmax(-1)
        else:
            drawn, logp = draw(logits, params.temperature, params.top_k, params.top_p, generator)
            sampling_logp[open_rows, t] = logp
        drawn_tokens[open_rows, t] = drawn
        length = t + 1
        still_open = drawn != eos_id
        open_rows = open_rows[still_open]
        done = len(open_rows) == 0
        if stop_together is not None:
            done = stop_together(done)
        if done or t == max_new_tokens - 1:
            break
        logits = decoder.advance(drawn, still_open, tokens.pad_id)
    drawn_tokens = drawn_tokens[:, :length]
    is_eos = drawn_tokens == eos_id
    # Mask: every token up to and including the first EOS (all tokens when there is none).
    after_eos = (is_eos.long().cumsum(-1) - is_eos.long()) > 0
    completion_mask = (~after_eos).long()
    return Turn(prompt_ids=prompt_ids, prompt_mask=prompt_mask, completion_ids=drawn_tokens,
                    completion_mask=completion_mask, truncated=~is_eos.any(-1), group_size=group_size,
                    sampling_logp=None if sampling_logp is None else sampling_logp[:, :length] * completion_mask)
