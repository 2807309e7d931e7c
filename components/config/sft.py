"""The supervised warm start before GRPO, with its checks."""

from __future__ import annotations

from dataclasses import dataclass

from components.config.rules import _require


@dataclass
class SFTConfig:
    """Supervised warm start: cross-entropy on answer tokens only."""

    enabled: bool = True
    """Run the SFT stage; when off, GRPO starts from the base model."""
    epochs: int = 30
    """Passes over the SFT data, at most (the default usually stops after 6-10: `stop_at_reward`)."""
    batch_size: int = 64
    """Examples per optimizer step."""
    learning_rate: float = 1e-3
    """Peak AdamW learning rate (cosine decay to 10%)."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    target_column: str = "answer"
    """The column SFT learns to write after the prompt: `answer`, or worked solutions (e.g. `solution`, which the
    `word_problems` task generates: the steps, then "The answer is N.") for a reasoning warm start."""
    stop_at_reward: float | None = 0.5
    """Stop once the greedy mean reward (grpo.rewards) on `check_prompts` GRPO training prompts reaches
    this: a partial warm start that lands in the same band on any CPU and seed, leaving GRPO room.
    null: train all epochs."""
    check_every: int = 20
    """Optimizer steps between those checks."""
    check_prompts: int = 200
    """Training prompts (never SFT demonstrations) the check decodes greedily."""


def check_sft(s: SFTConfig) -> None:
    """sft: epochs, the stop rule and its checks, batch and learning rate."""
    _require(s.epochs >= 1, "sft.epochs", "must be >= 1")
    _require(s.stop_at_reward is None or s.stop_at_reward > 0, "sft.stop_at_reward", "must be > 0, or null")
    _require(s.check_every >= 1, "sft.check_every", "must be >= 1")
    _require(s.check_prompts >= 1, "sft.check_prompts", "must be >= 1")
    _require(s.batch_size >= 1, "sft.batch_size", "must be >= 1")
    _require(s.learning_rate > 0, "sft.learning_rate", "must be > 0")
