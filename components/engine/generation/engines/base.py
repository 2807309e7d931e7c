"""What every rollout engine takes and returns: `SamplingParams` in, `Turn` out, behind `RolloutEngine`."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from components.engine.generation.rollouts import Turn


@dataclass(frozen=True)
class SamplingParams:
    """How completions are drawn: the same for every engine (vLLM's names where they exist)."""

    n: int = 1  # completions per prompt (the group size G)
    max_new_tokens: int = 16  # tokens per completion at most, EOS included
    temperature: float = 1.0
    top_p: float = 1.0  # nucleus: the smallest set of tokens whose probability reaches top_p
    top_k: int = 0  # only the k most likely tokens (0: all), applied before top_p as Hugging Face does
    greedy: bool = False  # the most likely token every step (temperature, top_p and top_k unused)
    ignore_eos: bool = False  # draw on past EOS: every completion runs to max_new_tokens (benchmarks at the budget)


@dataclass(frozen=True)
class SpecialTokens:
    """The tokenizer's ids an engine needs: where a completion ends and what fills rows after it."""

    eos_id: int
    pad_id: int

    @classmethod
    def of(cls, tokenizer: Any) -> SpecialTokens:
        return cls(tokenizer.eos_token_id, tokenizer.pad_token_id)


@dataclass(frozen=True)
class EngineRun:
    """What every engine may read about the run it serves (its own switches are its settings record,
    components/rollout_engines.py)."""

    vocab_size: int | None = None  # the tokenizer's (a self-check draws ids below it)
    max_length: int | None = None  # the longest prompt + completion row the run will see (None: the context)
    completion_length: int = 4  # `grpo.max_completion_length`
    gradient_checkpointing: bool = False  # training forwards recompute each layer in backward
    wrapped: bool = False  # forwards must go through a wrapper (DDP, FSDP2) or be the same for any process count
    stop_together: Callable[[bool], bool] | None = None  # sharded models decode in lockstep (FSDP2)


class Decoding(Protocol):
    """One decoding run over a batch of prompts that may go on for several turns (an episode's): each row's context
    stays encoded between turns, so what a tool or environment answers is appended to it, never re-encoded with the
    conversation before it. Made by `RolloutEngine.start`."""

    def turn(self, params: SamplingParams, generator: torch.Generator | None = None) -> Turn:
        """The next turn of every open row, drawn as `RolloutEngine.sample` draws (the same generator use): the first
        turn `params.n` rows per prompt, prompt-major, with the prompts as the rollouts' prompt part; a later turn one
        row per row kept by `extend`, in order, with an empty prompt part."""
        ...

    def extend(self, rows: Sequence[int], answers: Sequence[Sequence[int]], room: int) -> None:
        """Go on with `rows` only (indices into the last turn's rows, ascending): each one's last turn, then
        `answers[i]` (the tokens a tool or environment wrote, through the next turn's generation prompt), join its
        context. `room`: tokens the next turn may draw at most."""
        ...


class RolloutEngine(Protocol):
    """Generates completions and scores them with one model. Implementations: the entries of
    components/rollout_engines.py (hf.py, the plain Hugging Face forward the others are tested against;
    prefix_shared.py, the prompt-once path; cuda_graphs.py, captured decoding on a CUDA device)."""

    name: str

    def start(self, prompts: Sequence[Sequence[int]], continuing: bool = False) -> Decoding:
        """A decoding run over `prompts` (token ids); `continuing`: later turns may follow the first (the caches of
        rows that finish a turn are then kept for the next)."""
        ...

    def sample(self, prompts: Sequence[Sequence[int]], params: SamplingParams,
               generator: torch.Generator | None = None) -> Turn:
        """`params.n` completions of each prompt (token ids), prompt-major: `start(prompts).turn(params, generator)`.
        With the same generator state every engine draws the same tokens as the plain path (greedy, or sampled)."""
        ...

    def logprobs(self, rollouts: Turn, temperature: float,
                 with_entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Log-probs [N, T] of the completion tokens at `temperature` (0 where `completion_mask` is 0) and, with
        `with_entropy`, each position's entropy (no gradient). With gradients enabled they flow to the weights."""
        ...

    def over(self, model: Any) -> RolloutEngine:
        """The same engine, with the same options, over another model of the same architecture (the frozen
        reference)."""
        ...
