"""A step's rollout on its way from sampling to the update, in one object (torchtune's `GRPOTrajectory`).

Sampling fills the tokens; scoring adds the advantages and which tokens the loss sees; the reference (when the
loss has a KL term) and, with several passes, the old policy add their log-probs. Rows are prompt-major: group k
is rows k*G .. k*G+G-1, a layout every consumer reads from here (`group_size`, `group_rows`, `by_group`).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, replace

import torch

from components.config import GRPOConfig
from components.engine.grpo.objectives import GRPOLoss
from components.engine.models.rollout import Rollout


def group_rows(groups: Iterable[int], group_size: int) -> list[int]:
    """The rows of the given groups, in order: group k is rows k*G .. k*G+G-1, the layout of every rollout."""
    return [k * group_size + j for k in groups for j in range(group_size)]


def by_group(values: torch.Tensor, group_size: int) -> torch.Tensor:
    """A row per group: [N] -> [N / G, G]."""
    return values.view(-1, group_size)


@dataclass
class Trajectory:
    """What the update needs of a step's completions, row for row."""

    rollout: Rollout  # prompt and completion ids and masks [N, P] / [N, T]
    group_size: int  # G completions per prompt; group k holds rows k*G .. k*G+G-1
    advantages: torch.Tensor  # [N] group-relative advantage of each completion
    loss_mask: torch.Tensor  # [N, T] the completion tokens the loss sees (`loss_mask`)
    scorable: torch.Tensor | None = None  # [N] bool: a reward scored the row (None: every row)
    ref_logp: torch.Tensor | None = None  # [N, T] the reference's log-probs (loss with a KL term)
    old_logp: torch.Tensor | None = None  # [N, T] the sampling policy's log-probs (several passes or optimizer steps)

    def __len__(self) -> int:
        return len(self.rollout)

    def select(self, rows: list[int]) -> "Trajectory":
        """The given rows (itself when they are all rows in order: no copies)."""
        if rows == list(range(len(self))):
            return self

        def pick(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t[rows]

        return replace(self, rollout=self.rollout.select(rows), advantages=self.advantages[rows],
                       loss_mask=self.loss_mask[rows], scorable=pick(self.scorable), ref_logp=pick(self.ref_logp),
                       old_logp=pick(self.old_logp))

    def scored_rows(self) -> float:
        """Rows a reward scored (the sequence count of the grpo normaliser)."""
        return float(len(self)) if self.scorable is None else float(self.scorable.sum())


def loss_mask(rollout: Rollout, scorable: torch.Tensor, mask_truncated: bool) -> torch.Tensor:
    """The completion tokens the loss sees: none of a completion no reward scored, nor (DAPO's
    `mask_truncated_completions`) of one cut off at max_completion_length without EOS."""
    keep = scorable
    if mask_truncated:
        keep = keep & ~rollout.truncated
    return rollout.completion_mask * keep.unsqueeze(-1).to(rollout.completion_mask.dtype)


def scored_trajectory(rollout: Rollout, totals: list[float], loss: GRPOLoss, g: GRPOConfig,
                      device: torch.device) -> Trajectory:
    """The trajectory of a scored rollout: group-relative advantages of the rewards; a completion no reward scored
    (NaN) gets advantage 0 and none of its tokens in the loss."""
    rewards = torch.tensor(totals, dtype=torch.float32, device=device)
    scorable = ~torch.isnan(rewards)
    return Trajectory(rollout, g.group_size, loss.advantages(rewards),
                      loss_mask(rollout, scorable, g.mask_truncated_completions), scorable)
