"""Where each stage reads and writes, relative to the repository root (dvc.yaml names the same paths)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Paths:
    """The hand-off folders between stages (nanochat-style: each stage reads the previous one's outputs)."""

    root: Path = Path(".")

    @property
    def data(self) -> Path:
        return self.root / "data" / "prepared"

    @property
    def base_model(self) -> Path:
        return self.root / "models" / "base"

    @property
    def sft_model(self) -> Path:
        return self.root / "models" / "sft"

    @property
    def grpo_model(self) -> Path:
        return self.root / "models" / "grpo"

    @property
    def grpo_checkpoints(self) -> Path:
        return self.root / "checkpoints" / "grpo"

    @property
    def metrics(self) -> Path:
        return self.root / "metrics"

    @property
    def plots(self) -> Path:
        return self.root / "plots"

    @property
    def eval_dir(self) -> Path:
        return self.root / "eval"
