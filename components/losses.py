"""The policy-gradient losses, one entry each in `LOSSES`: a surrogate, an aggregation, clip statistics, a normaliser
and the entry's own settings record. A loss with a setting of its own is one entry here (its record, surrogate and
statistics beside it) and its test against TRL (tests/engine/grpo/test_against_trl.py), nothing else: the config's
`grpo.loss_type` takes its allowed names from this table, `GRPOConfig` inherits every record's fields as `grpo.*` keys
(checked by each field's rule), and `build_loss` hands the chosen entry its record, as torchtune's loss classes take
their settings in their constructor.

The maths is written with tensor methods only: this module imports no torch, so loading a config stays fast. Shapes:
B sequences, T completion positions; `ratio` is [B, T] (token level) or [B, 1] (sequence level), `adv` [B, 1],
`mask` [B, T] with 1 on the completion tokens the loss sees.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from components.records import read_record, rules_of, setting

if TYPE_CHECKING:
    from torch import Tensor


# ---- settings records: each loss's own `grpo.*` keys. Fields only (GRPOConfig inherits them), named as their keys.

@dataclass
class ClipRange:
    """The clipped surrogate's range [1 - epsilon, 1 + epsilon_high] (PPO; DAPO's clip-higher)."""

    epsilon: float = setting(0.2, "must be in (0, 1)", lambda v: 0 < v < 1)
    """Lower clip range of the importance ratio: ratio >= 1 - epsilon."""
    epsilon_high: float | None = setting(None, "must be > 0", lambda v: v is None or v > 0)
    """Upper clip range (DAPO clip-higher); unset means equal to `epsilon`."""


def clip_bounds(s: ClipRange) -> tuple[float, float]:
    """(epsilon low, epsilon high): `epsilon_high` unset is `epsilon`, a symmetric range."""
    return s.epsilon, s.epsilon if s.epsilon_high is None else s.epsilon_high


@dataclass
class CispoSettings:
    """`loss_type: cispo`."""

    cispo_max_ratio: float = setting(5.0, "must be > 0", lambda v: v > 0)
    """`loss_type: cispo`: the cap on the importance weight (ScaleRL's epsilon_max, 5.0 as it recommends). TRL
    reads this from `epsilon_high`; here `epsilon_high` keeps its one meaning (the clip range) and is refused with
    cispo."""


@dataclass
class SapoSettings:
    """`loss_type: sapo`: the soft gate's temperatures, by the sign of the advantage (TRL's defaults)."""

    sapo_temperature_pos: float = setting(1.0, "must be > 0", lambda v: v > 0)
    """`loss_type: sapo`: the gate's temperature for tokens with a positive advantage (TRL's default)."""
    sapo_temperature_neg: float = setting(1.05, "must be > 0", lambda v: v > 0)
    """`loss_type: sapo`: the gate's temperature for the other tokens (TRL's default; higher fades faster)."""


@dataclass(frozen=True)
class Normalisers:
    """What an aggregation divides by: counts of the whole accumulated step (or of the caller's rows when None), so
    minibatches or processes that each see part of a step add up to exactly the whole step's loss."""

    max_completion_length: int
    num_sequences: float | None = None
    num_tokens: float | None = None


# ---- surrogates: the per-token policy-gradient term of importance ratio `ratio` and advantage `adv`

def clipped(ratio: Tensor, logp: Tensor, adv: Tensor, s: ClipRange) -> Tensor:
    """PPO's clipped surrogate: -min(rho * A, clip(rho, 1 - eps_low, 1 + eps_high) * A)."""
    low, high = clip_bounds(s)
    clipped = ratio.clamp(1.0 - low, 1.0 + high)
    return -(ratio * adv).minimum(clipped * adv)


def capped_weight(ratio: Tensor, logp: Tensor, adv: Tensor, s: CispoSettings) -> Tensor:
    """CISPO (MiniMax-M1): -sg(min(rho, max_ratio)) * A * logp: the weight is capped, not the update, so a capped
    token still has a gradient."""
    return -ratio.clamp(max=s.cispo_max_ratio).detach() * adv * logp


def soft_gate(ratio: Tensor, logp: Tensor, adv: Tensor, s: SapoSettings) -> Tensor:
    """SAPO (2511.20347): -(4 / tau) * sigmoid(tau * (rho - 1)) * A, tau the positive-advantage temperature where
    A > 0 and the other one elsewhere: a gate whose gradient is 1 at rho = 1 and fades smoothly away from it."""
    tau = adv.new_full(adv.shape, s.sapo_temperature_pos).where(adv > 0, s.sapo_temperature_neg)
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

def ratio_outside_the_clip_range(ratio: Tensor, adv: Tensor, s: ClipRange) -> tuple[Tensor, Tensor]:
    """Clipped below (ratio < 1 - eps_low with A < 0) or above (ratio > 1 + eps_high with A > 0), as TRL counts."""
    epsilon_low, epsilon_high = clip_bounds(s)
    low = ((ratio < 1.0 - epsilon_low) & (adv < 0)).to(ratio.dtype)
    high = ((ratio > 1.0 + epsilon_high) & (adv > 0)).to(ratio.dtype)
    return low, high


def weight_capped(ratio: Tensor, adv: Tensor, s: CispoSettings) -> tuple[Tensor, Tensor]:
    """CISPO: weights capped where the advantage is positive (TRL's `cispo_clip_ratio`); nothing below."""
    high = ((ratio > s.cispo_max_ratio) & (adv > 0)).to(ratio.dtype)
    return high.new_zeros(high.shape), high


def never_clipped(ratio: Tensor, adv: Tensor, s: Any) -> tuple[Tensor, Tensor]:
    """SAPO has no hard clip."""
    zeros = ratio.new_zeros(ratio.shape)
    return zeros, zeros


@dataclass
class NoSettings:
    """A loss without settings of its own."""


Surrogate = Callable[["Tensor", "Tensor", "Tensor", Any], "Tensor"]  # (ratio, logp, adv, the entry's settings)
Aggregation = Callable[["Tensor", "Tensor", Normalisers], "Tensor"]
ClipStatistics = Callable[["Tensor", "Tensor", Any], "tuple[Tensor, Tensor]"]  # (ratio, adv, the entry's settings)


@dataclass(frozen=True)
class Loss:
    """One policy-gradient loss: how a token's term is formed, reduced, counted as clipped and normalised."""

    name: str
    surrogate: Surrogate
    aggregation: Aggregation
    clip_statistics: ClipStatistics
    settings: type = NoSettings
    """The record of this loss's own settings (its surrogate and clip statistics read it): a dataclass whose fields,
    made with `setting`, are `grpo.*` keys of the same names."""
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

    def settings_from(self, config: Any) -> Any:
        """This loss's settings record, each field read from the attribute of the same name (`GRPOConfig`)."""
        return read_record(self.settings, config)


LOSSES: dict[str, Loss] = {loss.name: loss for loss in (
    Loss("grpo", clipped, sequence_mean, ratio_outside_the_clip_range, ClipRange),
    Loss("bnpo", clipped, token_mean, ratio_outside_the_clip_range, ClipRange, per_minibatch=True),
    Loss("dapo", clipped, token_mean, ratio_outside_the_clip_range, ClipRange),
    Loss("dr_grpo", clipped, fixed_length_mean, ratio_outside_the_clip_range, ClipRange),
    Loss("cispo", capped_weight, token_mean, weight_capped, CispoSettings, equal_on_policy_to="dapo",
         gradient_through_ratio=False, replaces_epsilon_high="cispo_max_ratio"),
    Loss("sapo", soft_gate, sequence_mean, never_clipped, SapoSettings, equal_on_policy_to="grpo"),
)}

LossName = Literal[tuple(LOSSES)]  # type: ignore[valid-type]  # the config's allowed `grpo.loss_type` values

SETTINGS_RECORDS: tuple[type, ...] = tuple(dict.fromkeys(loss.settings for loss in LOSSES.values()))
"""Every entry's settings record, once each: `GRPOConfig` inherits their fields, so each field is a `grpo.*` key."""


def setting_rules() -> Iterator[tuple[str, Callable[[Any], bool], str]]:
    """(key, valid, rule) for every field of every entry's settings record that keeps a rule."""
    return rules_of(SETTINGS_RECORDS)

