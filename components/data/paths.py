"""Where each stage reads and writes, relative to the repository root (dvc.yaml names the same paths)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

DVC_ROOT_ENV = "DVC_ROOT"  # set by DVC for every stage it runs: the repository's root


def repository_root(root: Path = Path(".")) -> Path:
    """Where a run's shared state lives (the MLflow store, training checkpoints, the tracking queue): `root`,
    except in a DVC experiment run in a temporary copy of the repository (`dvc exp run --queue`, `--temp`),
    where it is the repository itself (DVC_ROOT), so that an experiment's runs land where a plain run's do."""
    dvc_root = os.environ.get(DVC_ROOT_ENV)
    if root == Path(".") and dvc_root and Path(dvc_root).resolve() != Path.cwd().resolve():
        return Path(dvc_root)
    return root


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
        """Training checkpoints (not a DVC output); a queued DVC experiment's go to the repository's own."""
        return repository_root(self.root) / "checkpoints" / "grpo"

    @property
    def metrics(self) -> Path:
        return self.root / "metrics"

    @property
    def plots(self) -> Path:
        return self.root / "plots"

    @property
    def eval_dir(self) -> Path:
        return self.root / "eval"
