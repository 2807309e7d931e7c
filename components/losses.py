"""The policy-gradient losses, one entry each in `LOSSES`: a surrogate, an aggregation, clip statistics and a
normaliser. The config's `grpo.loss_type` takes its allowed names from this table, and its rules read the entries'
properties, so adding a loss is one entry here and its test against TRL (tests/engine/grpo/test_against_trl.py).

The maths is written with tensor methods only: this module imports no torch, so loading a config stays fast. Shapes:
B sequences, T completion positions; `ratio` is [B, T] (token level) or [B, 1] (sequence level), `adv` [B, 1],
`mask` [B, T] with 1 on the completion tokens the loss sees.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from torch import Tensor


@dataclass(frozen=True)
class SurrogateSettings:
    """The knobs the surrogates read (`grpo.epsilon`, `epsilon_high`, `cispo_max_ratio`, `sapo_temperature_*`)."""

    epsilon_low: float = 0.2
    epsilon_high: float = 0.2
    cispo_max_ratio: float = 5.0
    sapo_temperatures: tuple[float, float] = (1.0, 1.05)  # (positive advantage, otherwise)


@dataclass(frozen=True)
class Normalisers:
    """What an aggregation divides by: counts of the whole accumulated step (or of the caller's rows when None), so
    minibatches or processes that each see part of a step add up to exactly the whole step's loss."""

    max_completion_length: int
    num_sequences: float | None = None
    num_tokens: float | None = None


# ---- surrogates: the per-token policy-gradient term of importance ratio `ratio` and advantage `adv`

def clipped(ratio: Tensor, logp: Tensor, adv: Tensor, s: SurrogateSettings) -> Tensor:
    """PPO's clipped surrogate: -min(rho * A, clip(rho, 1 - eps_low, 1 + eps_high) * A)."""
    clipped = ratio.clamp(1.0 - s.epsilon_low, 1.0 + s.epsilon_high)
    return -(ratio * adv).minimum(clipped * adv)


def capped_weight(ratio: Tensor, logp: Tensor, adv: Tensor, s: SurrogateSettings) -> Tensor:
    """CISPO (MiniMax-M1): -sg(min(rho, max_ratio)) * A * logp: the weight is capped, not the update, so a capped
    token still has a gradient."""
    return -ratio.clamp(max=s.cispo_max_ratio).detach() * adv * logp


def soft_gate(ratio: Tensor, logp: Tensor, adv: Tensor, s: SurrogateSettings) -> Tensor:
    """SAPO (2511.20347): -(4 / tau) * sigmoid(tau * (rho - 1)) * A, tau the positive-advantage temperature where
    A > 0 and the other one elsewhere: a gate whose gradient is 1 at rho = 1 and fades smoothly away from it."""
    tau = adv.new_full(adv.shape, s.sapo_temperatures[0]).where(adv > 0, s.sapo_temperatures[1])
    return -(tau * (ratio - 1.0)).sigmoid() * (4.0 / tau) * adv


# ---- aggregations: a [B, T] per-token loss to a scalar

def sequence_mean(per_token: Tensor, mask: Tensor, n: Normalisers) -> Tensor:
    """GRPO: each sequence's mean over its tokens, then the mean over sequences."""
    sequences = float(per_token.shape[0]) if n.num_sequences is None else n.num_sequences
    per_seq = (per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)
    return per_seq.sum() / sequences


def token_mean(per_token: Tensor, mask: Tensor, n: Normalisers) -> Tensor:
    """DAPO: the sum over all tokens / the number of tokens."""
    tokens = mask.sum().clamp(min=1.0) if n.num_tokens is None else max(n.num_tokens, 1.0)
    return (per_token * mask).sum() / tokens


def fixed_length_mean(per_token: Tensor, mask: Tensor, n: Normalisers) -> Tensor:
    """Dr. GRPO: the sum over all tokens / (sequences x max_completion_length): no length bias."""
    sequences = float(per_token.shape[0]) if n.num_sequences is None else n.num_sequences
    return (per_token * mask).sum() / (sequences * n.max_completion_length)


# ---- clip statistics: (low, high) per token, 1 where the surrogate clipped (logged as clip_low/high_frac)

def ratio_outside_the_clip_range(ratio: Tensor, adv: Tensor, s: SurrogateSettings) -> tuple[Tensor, Tensor]:
    """Clipped below (ratio < 1 - eps_low with A < 0) or above (ratio > 1 + eps_high with A > 0), as TRL counts."""
    low = ((ratio < 1.0 - s.epsilon_low) & (adv < 0)).to(ratio.dtype)
    high = ((ratio > 1.0 + s.epsilon_high) & (adv > 0)).to(ratio.dtype)
    return low, high


def weight_capped(ratio: Tensor, adv: Tensor, s: SurrogateSettings) -> tuple[Tensor, Tensor]:
    """CISPO: weights capped where the advantage is positive (TRL's `cispo_clip_ratio`); nothing below."""
    high = ((ratio > s.cispo_max_ratio) & (adv > 0)).to(ratio.dtype)
    return high.new_zeros(high.shape), high


def never_clipped(ratio: Tensor, adv: Tensor, s: SurrogateSettings) -> tuple[Tensor, Tensor]:
    """SAPO has no hard clip."""
    zeros = ratio.new_zeros(ratio.shape)
    return zeros, zeros


Surrogate = Callable[["Tensor", "Tensor", "Tensor", SurrogateSettings], "Tensor"]
Aggregation = Callable[["Tensor", "Tensor", Normalisers], "Tensor"]
ClipStatistics = Callable[["Tensor", "Tensor", SurrogateSettings], "tuple[Tensor, Tensor]"]


@dataclass(frozen=True)
class Loss:
    """One policy-gradient loss: how a token's term is formed, reduced, counted as clipped and normalised."""

    name: str
    surrogate: Surrogate
    aggregation: Aggregation
    clip_statistics: ClipStatistics
    per_minibatch: bool = False
    """Normalised by each minibatch's own token count, the step being the mean over minibatches (TRL's `bnpo`);
    otherwise by the whole accumulated step's counts (the accumulated gradient is then the one-pass gradient)."""
    equal_on_policy_to: str | None = None
    """With the ratio fixed at 1 (one pass, one optimizer step) this loss's update is exactly that loss's: it
    reshapes the surrogate of a group-relative objective (refused with `algorithm: reinforce`, warned then)."""
    gradient_through_ratio: bool = True
    """The gradient reaches each token through the importance ratio (False: the ratio is a detached weight), so a
    sequence-level ratio spreads it over every token and entropy masking cannot select tokens."""
    replaces_epsilon_high: str | None = None
    """The config key that caps this loss instead of `epsilon_high` (which is then refused)."""

    @property
    def per_sequence(self) -> bool:
        """Each sequence weighs the same whatever its length (a sequence-level ratio is then GSPO's objective)."""
        return self.aggregation is sequence_mean


LOSSES: dict[str, Loss] = {loss.name: loss for loss in (
    Loss("grpo", clipped, sequence_mean, ratio_outside_the_clip_range),
    Loss("bnpo", clipped, token_mean, ratio_outside_the_clip_range, per_minibatch=True),
    Loss("dapo", clipped, token_mean, ratio_outside_the_clip_range),
    Loss("dr_grpo", clipped, fixed_length_mean, ratio_outside_the_clip_range),
    Loss("cispo", capped_weight, token_mean, weight_capped, equal_on_policy_to="dapo", gradient_through_ratio=False,
         replaces_epsilon_high="cispo_max_ratio"),
    Loss("sapo", soft_gate, sequence_mean, never_clipped, equal_on_policy_to="grpo"),
)}

LossName = Literal[tuple(LOSSES)]  # type: ignore[valid-type]  # the config's allowed `grpo.loss_type` values
