"""A step's trajectory: everything the update needs of its completions, built once and never written to again
(torchtune's `GRPOTrajectory`). Rows keep the rollouts' layout: group k is rows k*G .. k*G+G-1, G being
`rollouts.group_size`, which every consumer asks for."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from components.engine.generation.rollouts import Rollouts
from components.engine.grpo.objectives import GRPOLoss


@dataclass(frozen=True)
class Trajectory:
    """What the update needs of a step's completions, row for row."""

    rollouts: Rollouts  # prompt and completion ids and masks [N, P] / [N, T]; its group_size is the layout
    advantages: torch.Tensor  # [N] the advantage of each completion
    loss_mask: torch.Tensor  # [N, T] the completion tokens the loss sees (`loss_mask`)
    scorable: torch.Tensor  # [N] bool: a reward scored the row
    ref_logp: torch.Tensor | None = None  # [N, T] the reference's log-probs (a loss with a KL term)
    old_logp: torch.Tensor | None = None  # [N, T] the sampling weights' log-probs (several passes or optimizer steps)

    def __len__(self) -> int:
        return len(self.rollouts)

    @property
    def group_size(self) -> int:
        return self.rollouts.group_size

    def select(self, rows: list[int]) -> Trajectory:
        """The given rows (itself when they are all rows in order: no copies)."""
        if rows == list(range(len(self))):
            return self

        def pick(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t[rows]

        return Trajectory(self.rollouts.select(rows), self.advantages[rows], self.loss_mask[rows], self.scorable[rows],
                          pick(self.ref_logp), pick(self.old_logp))

    def scored_rows(self) -> float:
        """Rows a reward scored (the sequence count of the grpo normaliser)."""
        return float(self.scorable.sum())


def loss_mask(rollouts: Rollouts, scorable: torch.Tensor, mask_truncated: bool) -> torch.Tensor:
    """The completion tokens the loss sees: the tokens the model wrote (in an episode, not what a tool or the
    environment answered), none of a completion no reward scored, nor (DAPO's `mask_truncated_completions`) of one
    cut off at max_completion_length without EOS (or an episode cut at a limit)."""
    keep = scorable
    if mask_truncated:
        keep = keep & ~rollouts.truncated
    dtype = rollouts.completion_mask.dtype
    return rollouts.written.to(dtype) * keep.unsqueeze(-1).to(dtype)


def build_trajectory(rollouts: Rollouts, advantage_rewards: list[float], loss: GRPOLoss, mask_truncated: bool,
                     ref_logp: torch.Tensor | None = None, old_logp: torch.Tensor | None = None) -> Trajectory:
    """The trajectory of scored rollouts: advantages of the rewards by the rollouts' groups; a completion no reward
    scored (NaN) gets advantage 0 and none of its tokens in the loss."""
    rewards = torch.tensor(advantage_rewards, dtype=torch.float32, device=rollouts.completion_ids.device)
    scorable = ~torch.isnan(rewards)
    return Trajectory(rollouts, loss.advantages(rewards, rollouts.group_size),
                      loss_mask(rollouts, scorable, mask_truncated), scorable, ref_logp, old_logp)
