"""The plain Hugging Face engine: the model's own forward and KV cache, for any causal LM. It is the reference every
other engine is tested against, and the engine of wrapped models (DDP, FSDP2), whose forwards must be the wrapper's.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from components.engine.generation.engines.base import EngineRun, SamplingParams, SpecialTokens
from components.engine.generation.engines.turns import LoopDecoding
from components.engine.generation.logprobs import completion_logprobs
from components.engine.generation.rollouts import Turn, left_pad, positions_from_mask
from components.engine.models.modeling import layer_checkpointing


class HFEngine:
    """Samples with the model's cache (each prompt encoded once, its cache expanded G times) and scores with its
    forward. A forward with gradients goes through `trainer` when given (DDP's wrapper averages the gradients);
    forwards without them through the model itself. Finished rows are fed the pad token: the model's cache keeps
    every row to the end of a turn (in a continuing run those positions are masked out of later turns)."""

    name = "hf"

    def __init__(self, model: Any, tokens: SpecialTokens, *, trainer: Any | None = None,
                 gradient_checkpointing: bool = False, stop_together: Callable[[bool], bool] | None = None):
        """`stop_together(done_here) -> done everywhere`: sharded (FSDP2) models decode in lockstep."""
        self.model, self.tokens, self.trainer = model, tokens, trainer
        self.gradient_checkpointing, self.stop_together = gradient_checkpointing, stop_together

    def start(self, prompts: Sequence[Sequence[int]], continuing: bool = False) -> LoopDecoding:
        """Under `no_grad` (not inference mode: a sharded model's parameters must not become inference tensors)."""
        def make(prompt_ids, prompt_mask, group_size, max_new_tokens, keep):
            return HFDecoder(self.model, prompt_ids, prompt_mask, group_size, max_new_tokens, keep)

        return LoopDecoding(make, prompts, self.tokens, next(self.model.parameters()).device, continuing,
                            torch.no_grad, stop_together=self.stop_together)

    def sample(self, prompts: Sequence[Sequence[int]], params: SamplingParams,
               generator: torch.Generator | None = None) -> Turn:
        return self.start(prompts).turn(params, generator)

    def logprobs(self, rollouts: Turn, temperature: float,
                 with_entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        module = self.trainer if self.trainer is not None and torch.is_grad_enabled() else self.model
        with layer_checkpointing(self.model, self.gradient_checkpointing):
            return completion_logprobs(module, rollouts, temperature, with_entropy)

    def over(self, model: Any) -> HFEngine:
        return HFEngine(model, self.tokens, gradient_checkpointing=self.gradient_checkpointing,
                        stop_together=self.stop_together)

    def with_trainer(self, trainer: Any) -> HFEngine:
        """This engine with gradient forwards through `trainer` (DDP's wrapper around this model)."""
        return HFEngine(self.model, self.tokens, trainer=trainer, gradient_checkpointing=self.gradient_checkpointing,
                        stop_together=self.stop_together)


def build_for_run(model: Any, tokens: SpecialTokens, run: EngineRun, settings: Any,
                  say: Callable[..., None] = print) -> HFEngine:
    """Always: any causal LM, device and process count (the registry's fallback)."""
    return HFEngine(model, tokens, gradient_checkpointing=run.gradient_checkpointing, stop_together=run.stop_together)


def conformance(model: Any, tokens: SpecialTokens, run: EngineRun) -> HFEngine:
    """The reference itself (the suite checks the others against it, and its row layout like theirs)."""
    return HFEngine(model, tokens)


class HFDecoder:
    """`turns.ContinuingDecoder` over the Hugging Face model's own cache. In a continuing run it records which cache
    positions hold real tokens (a finished row's padding does not), so a later turn's attention mask skips the rest."""

    def __init__(self, model: Any, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, group_size: int,
                 max_new_tokens: int, continuing: bool = False):
        out = model(input_ids=prompt_ids, attention_mask=prompt_mask, position_ids=positions_from_mask(prompt_mask),
                    use_cache=True)
        self.model, self.cache, self.logits = model, out.past_key_values, out.logits[:, -1, :]
        if group_size > 1:
            self.cache.batch_repeat_interleave(group_size)
            self.logits = self.logits.repeat_interleave(group_size, dim=0)
            prompt_mask = prompt_mask.repeat_interleave(group_size, dim=0)
        self._begin_turn(prompt_mask, max_new_tokens)
        self.real: list[torch.Tensor] | None = [prompt_mask.bool()] if continuing else None

    def _begin_turn(self, context_mask: torch.Tensor, max_new_tokens: int) -> None:
        """A turn's decoding state after `context_mask` ([rows, cache length]: 1 on real tokens) was encoded."""
        n, self.prompt_len = context_mask.shape
        self.attention = torch.cat([context_mask, torch.ones(n, max_new_tokens, dtype=context_mask.dtype,
                                                             device=context_mask.device)], 1)
        self.next_pos = context_mask.sum(-1, keepdim=True)
        self.open, self.offset = torch.arange(n, device=context_mask.device), 0

    def advance(self, drawn: torch.Tensor, still_open: torch.Tensor, pad_id: int) -> torch.Tensor:
        n, t = len(self.attention), self.offset
        tokens = drawn if len(self.open) == n else torch.full((n,), pad_id, dtype=drawn.dtype,
                                                               device=drawn.device).index_put_((self.open,), drawn)
        if self.real is not None:  # the rows fed a token they drew (the others are fed padding)
            self.real.append(torch.zeros(n, 1, dtype=torch.bool, device=drawn.device).index_fill_(0, self.open, True))
        step = self.model(input_ids=tokens[:, None], attention_mask=self.attention[:, : self.prompt_len + t + 1],
                          position_ids=self.next_pos + t, past_key_values=self.cache, use_cache=True)
        self.cache, self.offset, self.open = step.past_key_values, t + 1, self.open[still_open]
        logits = step.logits[:, -1, :]
        return logits if len(self.open) == n else logits[self.open]

    def extend(self, rows: torch.Tensor, chunks: Sequence[Sequence[int]], room: int) -> None:
        """One forward of each kept row's chunk (left-padded to the longest) over its cache."""
        real = torch.cat(self.real, 1).index_select(0, rows).long()
        self.cache.batch_select_indices(rows)
        chunk_ids, chunk_mask = left_pad(chunks, 0, rows.device)
        mask = torch.cat([real, chunk_mask], 1)
        positions = real.sum(-1, keepdim=True) + positions_from_mask(chunk_mask)
        out = self.model(input_ids=chunk_ids, attention_mask=mask, position_ids=positions, past_key_values=self.cache,
                         use_cache=True)
        self.cache, self.logits = out.past_key_values, out.logits[:, -1, :]
        self.real = [mask.bool()]
        self._begin_turn(mask, room)
