"""Turns on one decoding run (`base.Decoding`).

`LoopDecoding` serves the engines that draw on the host: each turn is the shared token loop (`token_loop.decode`)
over the engine's decoder, and between turns each row that goes on gets what it has not fed yet (its last drawn
token, when the loop stopped before feeding it) and the answer appended to its cache (`ContinuingDecoder.extend`):
a conversation is encoded once, as nanochat forces tool output into the running cache. `Reencoding` keeps the same
contract for an engine that can only `sample`: every later turn encodes each row's whole context again (what TRL's
tool loop does; the reference the others are tested against).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import Protocol

import torch

from components.engine.generation.engines.base import RolloutEngine, SamplingParams, SpecialTokens
from components.engine.generation.engines.token_loop import StepDecoder, decode
from components.engine.generation.rollouts import Turn, left_pad


class ContinuingDecoder(StepDecoder, Protocol):
    """A step decoder whose rows can go on after a turn: in a continuing run it feeds every row it holds at every
    step (finished rows are fed padding, masked out of every later turn) and knows which cache columns are real."""

    def extend(self, rows: torch.Tensor, chunks: Sequence[Sequence[int]], room: int) -> None:
        """Keep `rows` only, append `chunks[i]` to row i's context in one forward, make room for `room` more tokens;
        `logits` become each kept row's next-token logits."""
        ...


DecoderFactory = Callable[[torch.Tensor, torch.Tensor, int, int, bool], ContinuingDecoder]
"""(left-padded prompt ids, their mask, rows per prompt, first turn's token budget, continuing) -> the decoder."""


class LoopDecoding:
    """`base.Decoding` over a host-driven engine's decoder. `mode` is the grad mode its steps run under (inference
    mode rollouts are cloned into ordinary tensors with `clone`)."""

    def __init__(self, make_decoder: DecoderFactory, prompts: Sequence[Sequence[int]], tokens: SpecialTokens,
                 device: torch.device, continuing: bool, mode: Callable[[], AbstractContextManager],
                 clone: bool = False, stop_together: Callable[[bool], bool] | None = None):
        self.make_decoder, self.tokens, self.continuing, self.mode = make_decoder, tokens, continuing, mode
        self.clone, self.stop_together = clone, stop_together
        self.prompt_ids, self.prompt_mask = left_pad(prompts, tokens.pad_id, device)
        self.decoder: ContinuingDecoder | None = None
        self.last: Turn | None = None  # the last turn, as drawn

    def turn(self, params: SamplingParams, generator: torch.Generator | None = None) -> Turn:
        with self.mode():
            if self.decoder is None:
                self.decoder = self.make_decoder(self.prompt_ids, self.prompt_mask, params.n, params.max_new_tokens,
                                                 self.continuing)
                prompt_ids, prompt_mask = self.prompt_ids, self.prompt_mask
            else:
                params = dataclasses.replace(params, n=1)
                prompt_ids = prompt_mask = self.prompt_ids.new_zeros((len(self.decoder.logits), 0))
            self.last = decode(self.decoder, prompt_ids, prompt_mask, params, self.tokens, generator,
                               self.stop_together)
        return self.last.clone() if self.clone else self.last

    def extend(self, rows: Sequence[int], answers: Sequence[Sequence[int]], room: int) -> None:
        if self.decoder is None or self.last is None or not self.continuing:
            raise RuntimeError("extend follows a turn of a decoding run started with continuing=True")
        last = self.last
        fed = last.completion_ids.shape[1] - 1  # the loop feeds every token it draws but those of its last step
        lengths = last.completion_mask.sum(-1).tolist()
        chunks = [last.completion_ids[r, fed:lengths[r]].tolist() + list(answer) for r, answer in zip(rows, answers)]
        with self.mode():
            self.decoder.extend(torch.tensor(list(rows), dtype=torch.long, device=self.prompt_ids.device), chunks,
                                room)


class Reencoding:
    """`base.Decoding` for an engine that can only `sample`: each later turn samples from every kept row's whole
    context (prompt, turns, answers), encoded again."""

    def __init__(self, engine: RolloutEngine, prompts: Sequence[Sequence[int]]):
        self.engine, self.prompts = engine, [list(p) for p in prompts]
        self.contexts: list[list[int]] | None = None  # each row's context before its last turn
        self.last: Turn | None = None

    def turn(self, params: SamplingParams, generator: torch.Generator | None = None) -> Turn:
        if self.contexts is None:
            self.last = self.engine.sample(self.prompts, params, generator)
            self.contexts = [self.prompts[self.last.group_of_row(row)] for row in range(len(self.last))]
        else:
            self.last = self.engine.sample(self.contexts, dataclasses.replace(params, n=1), generator)
        return self.last

    def extend(self, rows: Sequence[int], answers: Sequence[Sequence[int]], room: int) -> None:
        if self.contexts is None or self.last is None:
            raise RuntimeError("extend follows a turn")
        written = self.last.completion_mask.sum(-1).tolist()
        self.contexts = [self.contexts[r] + self.last.completion_ids[r, :written[r]].tolist() + list(answer)
                         for r, answer in zip(rows, answers)]
