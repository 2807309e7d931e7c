"""The frozen base of a LoRA model as an engine: any engine with the model's adapters switched off while it samples
or scores. A LoRA run's reference is this (no second copy of the weights)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from components.engine.generation.engines.base import Decoding, RolloutEngine, SamplingParams
from components.engine.generation.engines.turns import Reencoding
from components.engine.generation.rollouts import Turn


class AdaptersOff:
    """An engine with its model's LoRA adapters switched off: the frozen base, which is a LoRA run's reference."""

    name = "adapters_off"

    def __init__(self, engine: RolloutEngine, model: Any):
        self.engine, self.model = engine, model

    def start(self, prompts: Sequence[Sequence[int]], continuing: bool = False) -> Decoding:
        return Reencoding(self, prompts)

    def sample(self, prompts: Sequence[Sequence[int]], params: SamplingParams,
               generator: torch.Generator | None = None) -> Turn:
        with self.model.disable_adapter():
            return self.engine.sample(prompts, params, generator)

    def logprobs(self, rollouts: Turn, temperature: float,
                 with_entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        with self.model.disable_adapter():
            return self.engine.logprobs(rollouts, temperature, with_entropy)

    def over(self, model: Any) -> RolloutEngine:
        return AdaptersOff(self.engine.over(model), model)
