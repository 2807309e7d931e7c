"""The GRPO stage: rewards, the KL reference, DAPO's dynamic sampling and overlong shaping, LoRA, and the
GRPO section itself, with the checks that need only that section."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Literal

from components.config.rules import _require
from components.losses import LOSSES, SETTINGS_RECORDS, LossName, setting_rules
from components.records import settings_keys
from components.rollout_engines import ENGINE_SETTINGS_RECORDS, engine_setting_rules


@dataclass
class RewardSpec:
    """One reward component: a built-in name or `package.module:function`, and its weight."""

    name: str = "exact_match"
    """Built-in reward name or a dotted path `package.module:function`."""
    weight: float = 1.0
    """Weight of this component in the summed reward."""
    options: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments for the reward (e.g. `pattern` for regex_format, `path` for judge_model)."""


@dataclass
class ReferenceConfig:
    """How the KL reference policy evolves."""

    mode: Literal["static", "ema", "periodic"] = "static"
    """`static`: frozen start policy; `ema`: ref <- (1-a)ref + a*policy each step; `periodic`: copy every
    `sync_every` steps."""
    ema_alpha: float = 0.01
    """EMA rate for `mode: ema`."""
    sync_every: int = 100
    """Steps between copies for `mode: periodic`."""
    path: str | None = None
    """A different checkpoint directory as the reference (default: a frozen copy of the start policy)."""


@dataclass
class DynamicSamplingConfig:
    """DAPO dynamic sampling: drop groups whose rewards are all equal (they carry no signal)."""

    enabled: bool = False
    """Drop zero-variance groups from the update."""
    fill_batch: bool = False
    """Keep sampling extra prompts until the batch is full again."""
    max_tries: int = 4
    """Extra sampling rounds at most per step when `fill_batch` is on."""


@dataclass
class OverlongConfig:
    """DAPO soft overlong punishment, added to the reward by completion length in tokens."""

    enabled: bool = False
    """Add the penalty."""
    buffer: int = 2
    """Tokens before `max_completion_length` where the penalty ramps from 0 to -penalty."""
    penalty: float = 1.0
    """Penalty at and beyond `max_completion_length`."""


@dataclass
class LoRAConfig:
    """Low-rank adapters (peft): only adapters train; the reference is the base with adapters off."""

    enabled: bool = False
    """Train LoRA adapters instead of all weights."""
    rank: int = 8
    """Adapter rank r."""
    alpha: float = 16.0
    """Scaling alpha (effective scale alpha / r)."""
    dropout: float = 0.0
    """Dropout on the adapter input."""
    target_modules: list[str] = field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"])
    """Module names (suffixes) that get adapters; each must exist in the model."""
    quantize_base: Literal["none", "nf4"] = "none"
    """`nf4`: the frozen base's decoder-layer projections stored in 4 bits (torchao's NF4, as torchtune's QLoRA;
    components/engine/models/quantize.py): about a quarter of their memory, dequantized by each forward. Needs
    torchao (`pip install -e '.[qlora]'`). Decoding with prefix sharing merges the dequantized weights per decoding
    run (the CUDA-graph engine keeps that merged copy); the saved adapters apply to the unquantized base."""


@dataclass
class EpisodeConfig:
    """Multi-turn episodes (`grpo.tools` or `grpo.environment`): the model acts, a tool or the environment answers.
    An episode's tokens after its prompt, the model's and the answers' together, are at most
    `grpo.max_completion_length` (an answer that would not fit ends the episode there, as TRL does)."""

    max_turns: int = 4
    """Model turns per episode at most; an episode still calling tools after the last is cut (counted)."""
    timeout_s: float = 10.0
    """Seconds a tool call, or an environment's reset or step, may take; past it the call fails (counted, and the
    model reads the error, or the episode ends)."""
    cut_reward: float = 0.0
    """The `environment_reward` of an episode a limit ended (`max_turns`, or the token budget) when its environment
    gives none (it has no `on_cut(reason)` method, or that returns None): a cut episode is scored, so it takes part in
    its group's comparison."""


@dataclass
class GRPOConfig(*SETTINGS_RECORDS, *ENGINE_SETTINGS_RECORDS):
    """The GRPO stage (DeepSeekMath 2402.03300; Dr. GRPO 2503.20783; DAPO 2503.14476; GSPO 2507.18071).

    The losses' own settings (`epsilon`, `epsilon_high`, `cispo_max_ratio`, `sapo_temperature_pos`, ...) are the
    fields of each loss's settings record in components/losses.py, and the rollout engines' (`prefix_sharing`,
    `cuda_graphs`, `onednn_matmul`) those of each engine's record in components/rollout_engines.py, inherited here as
    `grpo.*` keys."""

    algorithm: Literal["grpo", "reinforce"] = "grpo"
    """`grpo`, or the `reinforce` baseline: one sample per prompt, absolute reward, no KL (needs group_size 1)."""
    steps: int = 2000
    """Rollout steps (each followed by num_iterations updates)."""
    prompts_per_step: int = 16
    """Distinct prompts sampled per step; the batch is prompts_per_step * group_size completions."""
    group_size: int = 8
    """Completions per prompt (G); 1 only with `algorithm: reinforce`."""
    max_completion_length: int = 6
    """Generated tokens per completion at most (EOS included)."""
    temperature: float = 1.0
    """Sampling temperature for rollouts."""
    top_p: float = 1.0
    """Nucleus sampling threshold for rollouts."""
    top_k: int = 0
    """Sample rollouts from the k most likely tokens only (0 = all); applied before top_p, as Hugging Face does.
    The log-probs the loss uses stay those of the full distribution at `temperature` (TRL's choice too)."""
    learning_rate: float = 5e-4
    """Peak AdamW learning rate."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    warmup_steps: int = 10
    """Linear warmup steps before cosine decay."""
    min_lr_ratio: float = 0.1
    """Cosine decays to this fraction of the peak learning rate."""
    max_grad_norm: float = 1.0
    """Gradient clipping threshold (global L2 norm)."""
    kl_beta: float = 0.04
    """KL coefficient; 0 loads no reference model."""
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    """Per-token KL estimator (Schulman's k1/k2/k3). As a loss term k3's gradient is that of KL(ref || pi)
    (TRL's choice), k2's that of KL(pi || ref); k1's expected gradient is zero, so it is refused with kl_beta > 0."""
    loss_type: LossName = "dapo"
    """Loss aggregation: per-sequence mean (`grpo`); token mean over the whole accumulated batch (`dapo`) or over
    each minibatch, averaged over the minibatches (`bnpo`, as TRL); or sum / (N * max_len) (`dr_grpo`). Two more
    change the surrogate itself, as TRL's loss types of the same names: `cispo` (MiniMax-M1: the importance weight
    is capped at `cispo_max_ratio` and detached, times A * log-prob, so clipped tokens still get a gradient;
    aggregated as dapo) and `sapo` (a soft gate sigmoid(tau * (ratio - 1)) * 4 / tau in place of the hard clip;
    aggregated as grpo). Both differ from the plain surrogate only when the ratio moves off 1: with several
    passes (`num_iterations`) or optimizer steps (`gradient_accumulation_steps`) per rollout. The allowed names
    and each one's settings are the table in components/losses.py."""
    multi_objective_aggregation: Literal["sum_then_normalize", "normalize_then_sum"] = "sum_then_normalize"
    """With several rewards: sum them by weight, then form advantages (`scale_rewards`); or (GDPO, TRL's option of
    the same name) normalise each reward within its group first, sum by weight, and scale the sums by the batch's
    std, so a reward of a large scale does not drown the others. Needs two rewards or more and groups."""
    top_entropy_quantile: float = 1.0
    """The policy-gradient term on the top q of each minibatch's completion tokens by entropy only, the rest
    masked ("Beyond the 80/20 rule", 2506.01939, which recommends 0.2; TRL's option of the same name): 1 keeps
    every token, 0 only the highest. The KL term and the loss normalisers still count every token, as in TRL."""
    scale_rewards: Literal["group", "batch", "none"] = "group"
    """Advantage scaling: divide by group std, batch std, or nothing (Dr. GRPO)."""
    importance_sampling_level: Literal["token", "sequence"] = "token"
    """Per-token ratios, or one length-normalised ratio per sequence (GSPO)."""
    rollout_correction: Literal["none", "token_truncate", "token_mask", "sequence_truncate", "sequence_mask"] = "none"
    """Correct for the sampler's log-probs differing from the trainer's (a half-precision or captured decoder):
    each token's policy-gradient loss weighted by exp(trainer - sampler log-prob), per token or once per sequence,
    kept in [rollout_correction_min, rollout_correction_max] by clamping (`*_truncate`) or by a weight of 0 outside
    (`*_mask`); TRL's `vllm_importance_sampling_mode`s (components/engine/grpo/rollout_correction.py). `none`: the
    samples count as on-policy, which they are up to rounding in float32 (the on-policy check logs the gap)."""
    rollout_correction_max: float | None = 3.0
    """Upper bound of the correction's ratio (TRL's `vllm_importance_sampling_clip_max` default); null: none."""
    rollout_correction_min: float | None = None
    """Lower bound of the correction's ratio (TRL's `vllm_importance_sampling_clip_min`); null: none."""
    num_iterations: int = 1
    """Passes over each rollout (mu); old log-probs are cached at rollout time."""
    minibatch_size: int = 0
    """Completions per forward/backward (0 = the whole batch); a multiple of group_size."""
    gradient_checkpointing: Literal["auto", "always", "never"] = "auto"
    """Training forwards keep each decoder layer's input only and recompute the layer in backward (prefix-shared
    and plain Hugging Face forwards): activation memory of about one layer instead of all, for one more forward
    of the policy (docs/performance.md, long completions). `auto`: on when the grpo stage estimates that a step
    without it needs more than half the memory free at its start; the values are the same either way."""
    gradient_accumulation_steps: int = 0
    """Minibatches accumulated per optimizer step (0 = all of them: one step per pass)."""
    mask_truncated_completions: bool = False
    """Leave completions that hit max_completion_length without EOS out of the loss (DAPO)."""
    dynamic_sampling: DynamicSamplingConfig = field(default_factory=DynamicSamplingConfig)
    """DAPO dynamic sampling."""
    overlong: OverlongConfig = field(default_factory=OverlongConfig)
    """DAPO overlong reward shaping."""
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    """LoRA adapters via peft."""
    reference: ReferenceConfig = field(default_factory=ReferenceConfig)
    """KL reference policy."""
    rewards: list[RewardSpec] = field(default_factory=lambda: [RewardSpec()])
    """Reward components; their weighted sum drives the advantages. With episodes they read the model's last turn
    as the completion, and the whole episode in the `episode` column (plus `environment_reward`, `tool_calls`)."""
    tools: list[str] = field(default_factory=list)
    """Tools the model may call, each a built-in (`calculator`) or `package.module:function` with typed parameters
    and a docstring describing them (its JSON schema is built from both, as TRL does). Rollouts become episodes:
    tool calls are run and their results read back, until a turn calls none (docs/engine.md, "Tools and
    environments")."""
    environment: str | None = None
    """`package.module:factory` building one environment per rollout: `reset(record)` gives the first messages,
    `step(turn)` answers each model turn with messages or ends the episode (optionally with its reward). Not
    together with `tools` (an environment answers the model itself)."""
    episode: EpisodeConfig = field(default_factory=EpisodeConfig)
    """Limits of tool and environment episodes."""
    reward_timeout_s: float = 60.0
    """Time limit per reward call; a slower call fails that step (0 = no limit)."""
    max_reward_failures: int = 3
    """Steps in a row whose rewards failed (raised, NaN/inf, wrong length, timeout) that are skipped and
    logged before the stage stops with the reward's error."""
    checkpoint_every: int = 100
    """Steps between resumable checkpoints (0 disables)."""
    log_every: int = 100
    """Steps between progress lines."""
    keep: Literal["last", "best"] = "last"
    """Which weights become models/grpo: the last step's, or the held-out evaluation during training
    (`evaluate.every`) that scored best on `keep_metric` (saved as checkpoints/grpo/best). `best` picks on
    the held-out subset that the final evaluation also scores, so its gain there is optimistic by the
    selection; compare it with the champion on other data before trusting a small margin."""
    keep_metric: str = "reward"
    """The held-out metric (a greedy one of `evaluate.metrics`, or `reward`) that `keep: best` maximises."""
    metrics_every: int = 10
    """Steps per MLflow metrics point, each the mean over its window (TRL's `logging_steps`); 1 logs
    every step. Every step's values are in plots/grpo_steps.csv. Each point is one write of about 30 metrics to the
    tracking store, a noticeable share of a tiny-model step (docs/performance.md)."""



def _settings_keys_clash() -> list[str]:
    """Keys two settings records (losses', engines') share, or one shares with GRPOConfig's own fields (the latter
    would win silently, and the loss or engine read another setting)."""
    keys = [key for record in (*SETTINGS_RECORDS, *ENGINE_SETTINGS_RECORDS) for key in settings_keys(record)]
    return sorted({key for key in keys if keys.count(key) > 1 or key in GRPOConfig.__annotations__})


if _settings_keys_clash():
    raise TypeError(f"settings keys {_settings_keys_clash()} are taken: each field of a loss's or engine's settings "
                    "record (components/losses.py, components/rollout_engines.py) is a grpo.* key of its own")


def check_grpo(g: GRPOConfig) -> None:
    """grpo: every rule that needs only the grpo section (sizes, sampling, optimiser, KL, clipping, LoRA,
    reference, rewards); rules tying it to other sections run in `validate_config`."""
    _require(g.steps >= 1, "grpo.steps", "must be >= 1")
    _require(g.prompts_per_step >= 1, "grpo.prompts_per_step", "must be >= 1")
    if g.algorithm == "reinforce":
        _require(g.group_size == 1, "grpo.group_size",
                 "must be 1 with grpo.algorithm: reinforce (one sample per prompt)")
        _require(g.kl_beta == 0, "grpo.kl_beta", "must be 0 with grpo.algorithm: reinforce (no KL)")
    else:
        _require(g.group_size >= 2, "grpo.group_size",
                 "must be >= 2: group-relative advantages need at least two completions per prompt")
    batch = g.prompts_per_step * g.group_size
    _require(g.minibatch_size >= 0, "grpo.minibatch_size", "must be >= 0")
    _require(g.minibatch_size % g.group_size == 0, "grpo.minibatch_size",
             f"must be a multiple of grpo.group_size ({g.group_size}) so groups stay whole")
    _require(g.minibatch_size <= batch, "grpo.minibatch_size",
             f"must be <= the batch (prompts_per_step * group_size = {batch})")
    _require(g.gradient_accumulation_steps >= 0, "grpo.gradient_accumulation_steps", "must be >= 0")
    _require(g.dynamic_sampling.max_tries >= 1, "grpo.dynamic_sampling.max_tries", "must be >= 1")
    _require(not (g.dynamic_sampling.enabled and g.algorithm == "reinforce"), "grpo.dynamic_sampling.enabled",
             "must be false with grpo.algorithm: reinforce: with one completion per prompt no group has reward "
             "variance, so dynamic sampling would drop every batch and train nothing")
    _require(g.overlong.buffer >= 1 and g.overlong.buffer <= g.max_completion_length, "grpo.overlong.buffer",
             "must be in [1, grpo.max_completion_length]")
    _require(g.overlong.penalty >= 0, "grpo.overlong.penalty", "must be >= 0")
    _require(g.lora.rank >= 1, "grpo.lora.rank", "must be >= 1")
    _require(len(g.lora.target_modules) >= 1, "grpo.lora.target_modules", "needs at least one module name")
    _require(g.lora.quantize_base == "none" or g.lora.enabled, "grpo.lora.quantize_base",
             "quantizes the frozen base under LoRA adapters: set grpo.lora.enabled true, or quantize_base none")
    _require(not (g.lora.enabled and g.reference.mode != "static" and g.kl_beta > 0), "grpo.reference.mode",
             "must be static with LoRA: the reference is the base model with adapters disabled")
    _require(not (g.lora.enabled and g.reference.path), "grpo.reference.path",
             "must be unset with LoRA: the reference is the base model with adapters disabled")
    _require(g.max_completion_length >= 1, "grpo.max_completion_length", "must be >= 1")
    _require(g.temperature > 0, "grpo.temperature", "must be > 0")
    _require(0 < g.top_p <= 1, "grpo.top_p", "must be in (0, 1]")
    _require(g.top_k >= 0, "grpo.top_k", "must be >= 0 (0 = all tokens)")
    _require(g.learning_rate > 0, "grpo.learning_rate", "must be > 0")
    _require(g.warmup_steps >= 0, "grpo.warmup_steps", "must be >= 0")
    _require(0 <= g.min_lr_ratio <= 1, "grpo.min_lr_ratio", "must be in [0, 1]")
    _require(g.max_grad_norm > 0, "grpo.max_grad_norm", "must be > 0")
    _require(g.kl_beta >= 0, "grpo.kl_beta", "must be >= 0")
    _require(not (g.kl_beta > 0 and g.kl_estimator == "k1"), "grpo.kl_estimator",
             "k1 cannot be a loss term with grpo.kl_beta > 0: its expected gradient is exactly zero, so it "
             "would not regularise; use k3 (gradient of KL(ref || policy), TRL's choice) or k2 (gradient of "
             "KL(policy || ref))")
    _require(g.num_iterations >= 1, "grpo.num_iterations", "must be >= 1")
    _check_rollout_correction(g)
    _check_variants(g)
    _require(0 < g.reference.ema_alpha <= 1, "grpo.reference.ema_alpha", "must be in (0, 1]")
    _require(g.reference.sync_every >= 1, "grpo.reference.sync_every", "must be >= 1")
    _require(g.checkpoint_every >= 0, "grpo.checkpoint_every", "must be >= 0")
    _require(g.log_every >= 1, "grpo.log_every", "must be >= 1")
    _require(g.metrics_every >= 1, "grpo.metrics_every", "must be >= 1")
    _require(len(g.rewards) >= 1, "grpo.rewards", "needs at least one reward")
    _require(g.reward_timeout_s >= 0, "grpo.reward_timeout_s", "must be >= 0")
    _require(g.max_reward_failures >= 0, "grpo.max_reward_failures", "must be >= 0")
    _require(not (g.tools and g.environment), "grpo.environment",
             "cannot be set together with grpo.tools: an environment answers the model's turns itself (give it the "
             "tools it needs)")
    _require(g.episode.max_turns >= 1, "grpo.episode.max_turns", "must be >= 1")
    _require(g.episode.timeout_s > 0, "grpo.episode.timeout_s", "must be > 0")
    _require(math.isfinite(g.episode.cut_reward), "grpo.episode.cut_reward", "must be a finite number")


def _check_rollout_correction(g: GRPOConfig) -> None:
    high, low = g.rollout_correction_max, g.rollout_correction_min
    _require(high is None or high > 0, "grpo.rollout_correction_max", "must be > 0, or null for no upper bound")
    _require(low is None or low >= 0, "grpo.rollout_correction_min", "must be >= 0, or null for no lower bound")
    _require(high is None or low is None or low < high, "grpo.rollout_correction_min",
             f"must be below grpo.rollout_correction_max ({high})")
    _require(not (g.rollout_correction.endswith("truncate") and high is None and low is None),
             "grpo.rollout_correction_max", f"needs a value with grpo.rollout_correction: {g.rollout_correction} "
             "(truncation to no bound would change nothing)")


def _check_variants(g: GRPOConfig) -> None:
    """The losses' settings; CISPO, SAPO, multi-reward normalisation and entropy masking: refused where they are
    undefined or would silently be something else."""
    ratio_free = g.algorithm == "reinforce"
    loss = LOSSES[g.loss_type]
    _require(not (loss.equal_on_policy_to and ratio_free), "grpo.loss_type",
             f"{g.loss_type} is a GRPO objective (TRL defines it over group-relative advantages); grpo.algorithm: "
             "reinforce is the plain one-sample, baseline-free policy gradient the variants are compared against, "
             "and mixed with it would be neither: use loss_type dapo or grpo with reinforce")
    _require(not (loss.replaces_epsilon_high and g.epsilon_high is not None), "grpo.epsilon_high",
             f"has no meaning with grpo.loss_type: {g.loss_type}, which caps the weight at "
             f"grpo.{loss.replaces_epsilon_high} (TRL reads that cap from epsilon_high; set "
             f"{loss.replaces_epsilon_high} instead)")
    for key, valid, rule in (*setting_rules(), *engine_setting_rules()):  # the losses' and engines' own settings
        _require(valid(getattr(g, key)), f"grpo.{key}", rule)
    _require(0 <= g.top_entropy_quantile <= 1, "grpo.top_entropy_quantile", "must be in [0, 1] (1 = every token)")
    _require(not (g.top_entropy_quantile < 1 and g.importance_sampling_level == "sequence"
                  and loss.gradient_through_ratio), "grpo.top_entropy_quantile",
             "must be 1 with grpo.importance_sampling_level: sequence: the sequence ratio's gradient runs through "
             "every token, so masking tokens would only reweight sequences by how many high-entropy tokens they "
             "hold, not train on those tokens")
    if g.multi_objective_aggregation == "normalize_then_sum":
        count = len(g.rewards) + int(g.overlong.enabled)
        _require(count >= 2, "grpo.multi_objective_aggregation",
                 f"normalize_then_sum needs two rewards or more (grpo.rewards has {count}): with one it only "
                 "scales the advantages twice")
        _require(not ratio_free, "grpo.multi_objective_aggregation",
                 "normalize_then_sum normalises each reward within its group: grpo.algorithm: reinforce has none")
        _require(g.scale_rewards != "none", "grpo.scale_rewards",
                 "cannot be none with normalize_then_sum, which scales the summed rewards by the batch's std "
                 "(as TRL); use sum_then_normalize for Dr. GRPO's unscaled advantages")
