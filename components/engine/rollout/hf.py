"""The plain Hugging Face engine: the model's own forward and KV cache, for any causal LM. It is the reference every
other engine is tested against, and the engine of wrapped models (DDP, FSDP2), whose forwards must be the wrapper's.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from components.engine.models.logprobs import completion_logprobs
from components.engine.models.modeling import layer_checkpointing
from components.engine.models.rollouts import Rollouts, encode_prompts, left_pad, positions_from_mask
from components.engine.rollout.base import SamplingParams, SpecialTokens
from components.engine.rollout.token_loop import decode


class HFEngine:
    """Samples with the model's cache (each prompt encoded once, its cache expanded G times) and scores with its
    forward. A forward with gradients goes through `trainer` when given (DDP's wrapper averages the gradients);
    forwards without them through the model itself. Finished rows are fed the pad token: the model's cache keeps
    every row to the end of the run."""

    name = "hf"

    def __init__(self, model: Any, tokens: SpecialTokens, *, trainer: Any | None = None,
                 gradient_checkpointing: bool = False, stop_together: Callable[[bool], bool] | None = None):
        """`stop_together(done_here) -> done everywhere`: sharded (FSDP2) models decode in lockstep."""
        self.model, self.tokens, self.trainer = model, tokens, trainer
        self.gradient_checkpointing, self.stop_together = gradient_checkpointing, stop_together

    def sample(self, prompts: Sequence[Sequence[int]], params: SamplingParams,
               generator: torch.Generator | None = None) -> Rollouts:
        """Under `no_grad` (not inference mode: a sharded model's parameters must not become inference tensors)."""
        device = next(self.model.parameters()).device
        prompt_ids, prompt_mask = left_pad(prompts, self.tokens.pad_id, device)
        with torch.no_grad():
            decoder = HFDecoder(self.model, prompt_ids, prompt_mask, params.n, params.max_new_tokens)
            return decode(decoder, prompt_ids, prompt_mask, params, self.tokens, generator, self.stop_together)

    def logprobs(self, rollouts: Rollouts, temperature: float,
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


class HFDecoder:
    """`token_loop.StepDecoder` over the Hugging Face model's own cache."""

    def __init__(self, model: Any, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, group_size: int,
                 max_new_tokens: int):
        out = model(input_ids=prompt_ids, attention_mask=prompt_mask, position_ids=positions_from_mask(prompt_mask),
                    use_cache=True)
        self.model, self.cache, self.logits = model, out.past_key_values, out.logits[:, -1, :]
        if group_size > 1:
            self.cache.batch_repeat_interleave(group_size)
            self.logits = self.logits.repeat_interleave(group_size, dim=0)
            prompt_mask = prompt_mask.repeat_interleave(group_size, dim=0)
        n, self.prompt_len = prompt_mask.shape
        self.attention = torch.cat([prompt_mask, torch.ones(n, max_new_tokens, dtype=prompt_mask.dtype,
                                                            device=prompt_mask.device)], 1)
        self.next_pos = prompt_mask.sum(-1, keepdim=True)
        self.open, self.offset = torch.arange(n, device=prompt_mask.device), 0

    def advance(self, drawn: torch.Tensor, still_open: torch.Tensor, pad_id: int) -> torch.Tensor:
        n, t = len(self.attention), self.offset
        tokens = drawn if len(self.open) == n else torch.full((n,), pad_id, dtype=drawn.dtype,
                                                               device=drawn.device).index_put_((self.open,), drawn)
        step = self.model(input_ids=tokens[:, None], attention_mask=self.attention[:, : self.prompt_len + t + 1],
                          position_ids=self.next_pos + t, past_key_values=self.cache, use_cache=True)
        self.cache, self.offset, self.open = step.past_key_values, t + 1, self.open[still_open]
        logits = step.logits[:, -1, :]
        return logits if len(self.open) == n else logits[self.open]


def sample_texts(model: Any, tokenizer: Any, prompts: Sequence[str], params: SamplingParams,
                 generator: torch.Generator | None = None,
                 stop_together: Callable[[bool], bool] | None = None) -> Rollouts:
    """Completions of prompt texts with the plain engine (evaluation and SFT's stop check, on any model)."""
    engine = HFEngine(model, SpecialTokens.of(tokenizer), stop_together=stop_together)
    return engine.sample(encode_prompts(tokenizer, prompts), params, generator)
