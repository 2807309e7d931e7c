"""One typed config, built from params.yaml plus overrides and validated before anything runs.

Config flows one way: params.yaml -> `load_config` -> `PipelineConfig` -> stage functions.
Every failure is a `ConfigError` whose message names the offending key.
"""

from __future__ import annotations

import dataclasses
import difflib
import hashlib
import json
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml


class ConfigError(ValueError):
    """A params key is unknown, mistyped or out of range; the message names the key."""


@dataclass
class TaskConfig:
    """The embedded procedural task (used when no user data is given)."""

    name: Literal["addition", "addition_question", "word_problems"] = "addition"
    """Built-in task generator. `addition`: "37+45=" -> "82"; `addition_question`: "What is 37 + 45?" -> "82";
    `word_problems`: two-step word problems ("Ana has 7 apples. Ana buys 5 more and then gives 3 away. ...") -> "9"."""
    min_operand: int = 0
    """Smallest operand (inclusive)."""
    max_operand: int = 99
    """Largest operand (inclusive)."""
    n_sft: int = 1500
    """Demonstrations for the SFT warm start."""
    n_train: int = 4000
    """GRPO prompts (answers used only by the reward)."""
    n_heldout: int = 1000
    """Held-out evaluation prompts."""


@dataclass
class DataConfig:
    """User datasets. Any path set here replaces the generated split of the same name."""

    sft_path: str | None = None
    """Demonstrations for the SFT warm start (default with user data: the train split)."""
    train_path: str | None = None
    """GRPO prompts with answers (+ extra columns passed to rewards)."""
    heldout_path: str | None = None
    """Held-out evaluation data (default with user data: `heldout_ratio` of train_path, split off)."""
    format: Literal["auto", "jsonl", "json", "csv", "parquet", "hf"] = "auto"
    """File format; `auto` goes by extension (`hf`: a `datasets` save_to_disk directory)."""
    columns: dict[str, str] = field(default_factory=dict)
    """Renames from source column to pipeline column, e.g. {question: prompt}; other columns are kept."""
    heldout_ratio: float = 0.1
    """Share of train_path held out when heldout_path is unset (identical prompts stay together)."""
    split_seed: int | None = None
    """Seed of that split (default: `seed`)."""


@dataclass
class PromptConfig:
    """How a record becomes the text the model sees."""

    template: str = "{prompt}"
    """Python format string over the record's fields, e.g. "Question: {prompt}\\nAnswer:"."""
    system: str | None = None
    """Optional system prompt (a system message with chat templates, a first line otherwise)."""
    chat_template: Literal["auto", "always", "never"] = "auto"
    """Apply the tokenizer's chat template with the generation prompt: `auto` when it has one."""


@dataclass
class TinyModelConfig:
    """Shape of the tiny Llama built offline when `model.name_or_path` is unset."""

    hidden_size: int = 128
    """Width of the residual stream."""
    num_layers: int = 4
    """Transformer blocks."""
    num_heads: int = 4
    """Attention heads (hidden_size must divide by it)."""
    intermediate_size: int = 256
    """MLP width."""
    max_position_embeddings: int = 32
    """Context length in tokens (characters, with the char tokenizer)."""


@dataclass
class ModelConfig:
    """The starting policy."""

    name_or_path: str | None = None
    """A local Hugging Face model directory, a `.gguf` file (converted once to safetensors by the `model`
    stage), or `package:MODULE/FILE.gguf` for a GGUF shipped inside an installed Python package; unset
    builds the tiny default from `tiny`."""
    gguf_file: str | None = None
    """The GGUF file's name when name_or_path is the folder holding it."""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """Weights dtype; `auto`: bfloat16 on a GPU that supports it, float32 otherwise."""
    trust_remote_code: bool = False
    """Allow model code shipped inside the model directory (off unless you trust it)."""
    allow_download: bool = False
    """Let a hub id in name_or_path be downloaded by transformers (also needs HF_HUB_OFFLINE unset or 0)."""
    tiny: TinyModelConfig = field(default_factory=TinyModelConfig)
    """Architecture of the tiny default."""


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
    """`static`: frozen start policy; `ema`: ref <- (1-a)ref + a*policy each step; `periodic`: copy every `sync_every` steps."""
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


@dataclass
class GRPOConfig:
    """The GRPO stage (DeepSeekMath 2402.03300; Dr. GRPO 2503.20783; DAPO 2503.14476; GSPO 2507.18071)."""

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
    epsilon: float = 0.2
    """Lower clip range of the importance ratio: ratio >= 1 - epsilon."""
    epsilon_high: float | None = None
    """Upper clip range (DAPO clip-higher); unset means equal to `epsilon`."""
    loss_type: Literal["grpo", "bnpo", "dapo", "dr_grpo"] = "dapo"
    """Loss aggregation: per-sequence mean (`grpo`); token mean over the whole accumulated batch (`dapo`) or over
    each minibatch, averaged over the minibatches (`bnpo`, as TRL); or sum / (N * max_len) (`dr_grpo`)."""
    scale_rewards: Literal["group", "batch", "none"] = "group"
    """Advantage scaling: divide by group std, batch std, or nothing (Dr. GRPO)."""
    importance_sampling_level: Literal["token", "sequence"] = "token"
    """Per-token ratios, or one length-normalised ratio per sequence (GSPO)."""
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
    prefix_sharing: bool = True
    """Encode each prompt once per group in sampling, reference and policy forwards (components/engine/fastlm.py).
    Llama/Qwen2/Qwen3/Mistral only, checked against the Hugging Face forward at start; others fall back.
    Not used with several processes or per-group sampling (those need the wrapped, N-independent forward)."""
    onednn_matmul: bool = True
    """With prefix sharing, float32 matrix products of 8M multiply-adds or more on the CPU run on oneDNN's kernels
    (components/engine/matmul.py): about twice MKL's speed on AMD processors with AVX-512 (measured on Zen 5); on
    Intel's MKL already runs AVX-512, so expect little change. Rounding differs from PyTorch's own products; false keeps
    those."""
    dynamic_sampling: DynamicSamplingConfig = field(default_factory=DynamicSamplingConfig)
    """DAPO dynamic sampling."""
    overlong: OverlongConfig = field(default_factory=OverlongConfig)
    """DAPO overlong reward shaping."""
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    """LoRA adapters via peft."""
    reference: ReferenceConfig = field(default_factory=ReferenceConfig)
    """KL reference policy."""
    rewards: list[RewardSpec] = field(default_factory=lambda: [RewardSpec()])
    """Reward components; their weighted sum drives the advantages."""
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
    every step. Every step's values are in plots/grpo_steps.csv. A point per step costs about 5 ms
    of SQLite writes (28 metrics), about 6% of a tiny-model step (0.079 s median in the benchmark at 8a3e357)."""


@dataclass
class EvaluateConfig:
    """Held-out evaluation with greedy decoding."""

    max_new_tokens: int = 6
    """Greedy decoding budget per prompt."""
    batch_size: int = 250
    """Prompts decoded at once."""
    bootstrap_samples: int = 10000
    """Resamples for the paired 95% bootstrap interval."""
    metrics: list[str] = field(default_factory=lambda: ["reward", "pass@4", "completion_length", "eos_rate"])
    """Task metrics on held-out completions, each for baseline and candidate with a paired 95% CI
    (components/engine/task_metrics.py): `reward` (the training reward's weighted sum, always computed),
    a reward's name (a built-in or `module:function`, scored alone), `pass@k` (share of prompts with a
    correct completion among k samples at `pass_k_temperature`; unbiased estimator), `completion_length`
    (tokens) and `eos_rate` (share of completions that end with EOS within `max_new_tokens`)."""
    pass_k_temperature: float = 1.0
    """Sampling temperature of the pass@k completions."""
    pass_k_top_p: float = 1.0
    """Nucleus threshold of the pass@k completions."""
    pass_k_top_k: int = 0
    """Top-k of the pass@k completions (0 = all tokens)."""
    pass_k_samples: int = 0
    """Completions sampled per prompt for pass@k (0 = k); more lowers the estimator's variance."""
    correct_at: float = 1.0
    """A sampled completion counts as correct for pass@k when its training reward total is >= this."""
    every: int = 200
    """GRPO steps between held-out evaluations during training (0 = off): greedy metrics on
    `during_training_n` held-out prompts, logged as MLflow curves (`heldout/...`) and as one MLflow
    LoggedModel per evaluated step; also at the last step."""
    during_training_n: int = 200
    """Held-out prompts (the first N, always the same) scored during training."""


@dataclass
class RegisterConfig:
    """MLflow Model Registry."""

    model_name: str = "grpo-addition"
    """Registered model name."""
    min_ci_low: float = 0.0
    """A challenger replaces the champion only if the CI lower bound of its improvement exceeds this."""
    gate_metric: str = "reward"
    """The held-out metric (one of `evaluate.metrics`, or `reward`) compared with the champion's."""
    require_improvement: bool = True
    """With no champion yet, the first version becomes champion only when it beats the model GRPO started from (the
    baseline this run evaluated) on `gate_metric`: paired 95% CI low > 0. false: the first version is champion
    whatever it measured."""
    merge_lora: bool = False
    """With LoRA, register the base with the adapter merged in (a full copy) instead of the adapter alone,
    which is linked to its base (registered once as `<model_name>-base`)."""


@dataclass
class TrackingConfig:
    """MLflow tracking."""

    experiment: str = "grpo-pipeline"
    """Experiment holding the pipeline's runs."""
    metrics_flush_s: float = 5.0
    """Seconds between writes of GRPO's pending metric points to MLflow (one point per `grpo.metrics_every`
    steps either way). Most of a write's cost is per write: on SQLite about 3.5 ms plus 0.045 ms a metric,
    so ten points in one write cost 1.9 ms each instead of 5. Pending points are written when the stage
    ends, fails or is stopped; a killed process (SIGKILL) loses at most these seconds of them. 0 writes
    each point at once."""


@dataclass
class OperationsConfig:
    """Served and deployed runs (`grpo-pipeline serve | deploy | setup | data update`)."""

    deployment: str = "grpo-pipeline"
    """Prefect deployment name."""
    cron: str | None = None
    """Cron schedule of the served/deployed pipeline (e.g. "0 3 * * *"); null = runs only on triggers."""
    timezone: str = "UTC"
    """Time zone the cron schedule is read in."""
    trigger_event: str = "grpo.dataset.updated"
    """Event (emitted by `grpo-pipeline data update`) that starts a run of this repository's deployment."""
    gpu_concurrency: int = 1
    """Task runs tagged `gpu` (sft, grpo, evaluate) allowed at once on the Prefect server."""
    lock_wait_s: float = 21600.0
    """How long a served run waits for another run of the same repository to finish before failing."""
    stage_retries: int = 2
    """Retries of a stage that failed for a transient reason (tracking server unreachable); never others."""
    retry_delay_s: float = 10.0
    """First retry delay; each further retry waits 3x longer (backoff)."""


@dataclass
class ReportsConfig:
    """Pictures and tables for people: DVC plots, MLflow figures and completion tables."""

    samples_every: int = 100
    """Every N GRPO steps, log a table of sampled completions to MLflow (0 = never)."""
    samples_rows: int = 32
    """Completions per logged sample table."""


@dataclass
class DistributedConfig:
    """Multi-process training of the sft and grpo stages on torch.distributed (DDP)."""

    nproc: int = 1
    """Processes per node; > 1 makes the stage re-launch itself under torchrun (one per GPU, or CPU gloo)."""
    backend: Literal["auto", "gloo", "nccl"] = "auto"
    """Process-group backend; `auto`: nccl on CUDA, gloo on CPU."""
    per_group_sampling: bool = False
    """Seed each prompt group's sampler from (seed, step, prompt position) so completions do not depend
    on how prompts are sharded; always on with more than one process (slower than the batched sampler)."""
    strategy: Literal["ddp", "fsdp2"] = "ddp"
    """ddp: a whole model per process; fsdp2: weights, gradients and optimizer state sharded over the
    processes (torch fully_shard per decoder layer) for models that do not fit one GPU. Not with LoRA."""


@dataclass
class MonitorSpec:
    """One reward-hacking check: a signal (components/engine/monitors.py) against a threshold."""

    signal: Literal["kl", "entropy", "completion_length", "completion_length_growth", "reward_mean",
                    "zero_std_group_frac", "reward_heldout_gap", "heldout_drop", "heldout_flat"] = "heldout_drop"
    """kl, entropy, completion_length, reward_mean, zero_std_group_frac: means over the last `window` steps;
    completion_length_growth: that mean over step 1's (sampled from the start policy), minus 1; reward_heldout_gap: training reward
    minus the last held-out `reward`; heldout_drop: how far the held-out `grpo.keep_metric` fell over the last
    `evaluations` evaluations while the training reward rose (0 otherwise); heldout_flat: judged once, at the
    last step: the training reward's rise over the run when the held-out `grpo.keep_metric` did not rise over
    the start model by more than its noise (1.96 paired standard errors), 0 otherwise."""
    above: float | None = None
    """Breached when the signal exceeds this."""
    below: float | None = None
    """Breached when the signal falls under this."""
    action: Literal["block", "warn"] = "block"
    """block: the version is registered but never made champion; warn: tagged and printed only."""


@dataclass
class NotLearningConfig:
    """When to say, while training runs, that GRPO is not learning (and what to try)."""

    window: int = 400
    """Steps compared: the last `window` steps against the first `window`, once 2 * window steps ran. On the
    default the reward is flat for its first ~300 steps, then climbs: 400 leaves room for a slower start."""
    min_reward_gain: float = 0.05
    """Flat: the training reward's mean over the last window exceeds the first window's by less than this."""
    zero_variance_above: float = 0.5
    """Starved (named as the likely cause): over the last window, more than this share of groups scored
    zero on every completion."""


@dataclass
class NoSignalConfig:
    """The early warning that the first steps carry no learning signal (every completion of a group scored alike)."""

    steps: int = 10
    """Judged once, after this many steps (or at the last step of a shorter run); 0 turns it off."""
    zero_variance_above: float = 0.9
    """Said when, over those steps, more than this share of groups scored every completion the same."""


@dataclass
class MonitorsConfig:
    """Reward-hacking monitors (a breach is an MLflow tag; `block` keeps the version from `champion`)
    and the not-learning warning."""

    window: int = 50
    """Steps averaged for the per-step signals."""
    evaluations: int = 3
    """Held-out evaluations (evaluate.every) spanned by `heldout_drop`."""
    checks: list[MonitorSpec] = field(default_factory=lambda: [
        MonitorSpec("heldout_drop", above=0.05, action="block"),
        MonitorSpec("heldout_flat", above=0.1, action="warn"),
        MonitorSpec("completion_length_growth", above=1.0, action="warn")])
    """The checks; every breach is recorded with its step and value."""
    not_learning: NotLearningConfig = field(default_factory=NotLearningConfig)
    """The not-learning warning."""
    no_signal: NoSignalConfig = field(default_factory=NoSignalConfig)
    """The early no-signal warning."""


@dataclass
class PipelineConfig:
    """Everything a pipeline run needs; mirrors params.yaml key for key."""

    seed: int = 1234
    """One seed for Python, NumPy, torch, data order and the rollout sampler."""
    threads: int = 2
    """torch intra-op threads (0 = leave torch's default)."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Training device; `auto` picks CUDA when present."""
    task: TaskConfig = field(default_factory=TaskConfig)
    data: DataConfig = field(default_factory=DataConfig)
    prompt: PromptConfig = field(default_factory=PromptConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    sft: SFTConfig = field(default_factory=SFTConfig)
    grpo: GRPOConfig = field(default_factory=GRPOConfig)
    evaluate: EvaluateConfig = field(default_factory=EvaluateConfig)
    register: RegisterConfig = field(default_factory=RegisterConfig)
    monitors: MonitorsConfig = field(default_factory=MonitorsConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    operations: OperationsConfig = field(default_factory=OperationsConfig)
    reports: ReportsConfig = field(default_factory=ReportsConfig)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)


# --------------------------------------------------------------------------- building


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _coerce(value: Any, tp: Any, key: str) -> Any:
    """Check `value` against the annotation `tp`, converting YAML scalars where lossless."""
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(value, arg, key)
            except ConfigError as err:
                errors.append(str(err))
        raise ConfigError(errors[0] if errors else f"{key}: invalid value {value!r}")
    if origin is Literal:
        if value not in args:
            raise ConfigError(f"{key}: {value!r} is not one of {', '.join(map(repr, args))}")
        return value
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a mapping, got {type(value).__name__}")
        return dict(value)
    if origin is list:
        if not isinstance(value, list):
            raise ConfigError(f"{key}: expected a list, got {type(value).__name__}")
        return [_coerce(item, args[0], f"{key}[{i}]") for i, item in enumerate(value)]
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a mapping, got {type(value).__name__}")
        return _build(tp, value, key)
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{key}: expected true or false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{key}: expected an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, str):  # PyYAML (YAML 1.1) reads 1e-4 as a string; YAML 1.2 and users mean a number
            try:
                value = float(value)
            except ValueError:
                pass
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{key}: expected a number, got {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{key}: expected a string, got {value!r}")
        return value
    raise ConfigError(f"{key}: unsupported type {_type_name(tp)}")


def _build(cls: type, raw: dict[str, Any], prefix: str = "") -> Any:
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for key, value in raw.items():
        full = f"{prefix}.{key}" if prefix else str(key)
        if key not in hints:
            close = difflib.get_close_matches(str(key), names, n=1)
            hint = f" (did you mean '{prefix + '.' if prefix else ''}{close[0]}'?)" if close else ""
            raise ConfigError(f"{full}: unknown key{hint}")
        kwargs[key] = _coerce(value, hints[key], full)
    return cls(**kwargs)


def _parse_scalar(text: str) -> Any:
    """Parse a `--set` value the way YAML would ("0.1" -> 0.1, "true" -> True, "null" -> None)."""
    return yaml.safe_load(text) if text.strip() else ""


def apply_override(raw: dict[str, Any], assignment: str) -> None:
    """Apply one `key.sub=value` override to a raw params mapping in place."""
    if "=" not in assignment:
        raise ConfigError(f"{assignment}: overrides look like key.sub=value")
    dotted, text = assignment.split("=", 1)
    parts = dotted.strip().split(".")
    node = raw
    for part in parts[:-1]:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(f"{dotted}: '{part}' is not a section")
    node[parts[-1]] = _parse_scalar(text)


def read_params(path: str | Path) -> dict[str, Any]:
    """Read a params YAML file into a plain mapping (empty file -> {})."""
    path = Path(path)
    if not path.exists():
        raise ConfigError(f"{path}: params file does not exist")
    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as err:
        raise ConfigError(f"{path}: not valid YAML: {err}") from err
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: top level must be a mapping")
    return raw


def config_from_dict(raw: dict[str, Any]) -> PipelineConfig:
    """Build and validate a config from a raw mapping."""
    cfg = _build(PipelineConfig, raw)
    validate_config(cfg)
    return cfg


def load_config(path: str | Path = "params.yaml", overrides: list[str] | None = None) -> PipelineConfig:
    """params.yaml + `key=value` overrides -> a validated `PipelineConfig`."""
    raw = read_params(path)
    for assignment in overrides or []:
        apply_override(raw, assignment)
    return config_from_dict(raw)


class _AnyField(dict):
    """Lets a template be checked for syntax without knowing the record's fields."""

    def __missing__(self, key: str) -> str:
        return ""


def _require(condition: bool, key: str, rule: str) -> None:
    if not condition:
        raise ConfigError(f"{key}: {rule}")


def validate_config(cfg: PipelineConfig) -> None:
    """Refuse settings that cannot work, before any data or model is touched."""
    t, g, s, e = cfg.task, cfg.grpo, cfg.sft, cfg.evaluate
    _require(cfg.threads >= 0, "threads", "must be >= 0")
    _require(0 <= t.min_operand <= t.max_operand, "task.max_operand", "must be >= task.min_operand >= 0")
    for name in ("n_sft", "n_train", "n_heldout"):
        _require(getattr(t, name) >= 1, f"task.{name}", "must be >= 1")
    if t.name != "word_problems":  # word_problems counts its own when it generates them (tasks.py)
        span = (t.max_operand - t.min_operand + 1) ** 2
        _require(t.n_sft + t.n_train + t.n_heldout <= span, "task.n_train",
                 f"n_sft + n_train + n_heldout exceeds the {span} distinct problems of the operand range")
    tiny = cfg.model.tiny
    _require(tiny.hidden_size % tiny.num_heads == 0, "model.tiny.num_heads", "must divide model.tiny.hidden_size")
    for name in ("hidden_size", "num_layers", "num_heads", "intermediate_size", "max_position_embeddings"):
        _require(getattr(tiny, name) >= 1, f"model.tiny.{name}", "must be >= 1")
    _require(0 < cfg.data.heldout_ratio < 1, "data.heldout_ratio", "must be in (0, 1)")
    for source, target in cfg.data.columns.items():
        _require(isinstance(target, str) and bool(target), f"data.columns.{source}", "must name a target column")
    try:
        cfg.prompt.template.format_map(_AnyField())
    except (ValueError, IndexError) as err:
        raise ConfigError(f"prompt.template: not a valid format string ({err})") from err
    _require(s.epochs >= 1, "sft.epochs", "must be >= 1")
    _require(s.stop_at_reward is None or s.stop_at_reward > 0, "sft.stop_at_reward", "must be > 0, or null")
    _require(s.check_every >= 1, "sft.check_every", "must be >= 1")
    _require(s.check_prompts >= 1, "sft.check_prompts", "must be >= 1")
    ops = cfg.operations
    _require(ops.cron is None or len(ops.cron.split()) in (5, 6), "operations.cron",
             "must be a cron expression with 5 fields (minute hour day month weekday), or null")
    _require(ops.gpu_concurrency >= 1, "operations.gpu_concurrency", "must be >= 1")
    _require(ops.lock_wait_s >= 0, "operations.lock_wait_s", "must be >= 0")
    _require(ops.stage_retries >= 0, "operations.stage_retries", "must be >= 0")
    _require(ops.retry_delay_s >= 0, "operations.retry_delay_s", "must be >= 0")
    _require(bool(ops.deployment.strip()), "operations.deployment", "must not be empty")
    _require(cfg.reports.samples_every >= 0, "reports.samples_every", "must be >= 0")
    _require(cfg.tracking.metrics_flush_s >= 0, "tracking.metrics_flush_s", "must be >= 0")
    _require(cfg.reports.samples_rows >= 1, "reports.samples_rows", "must be >= 1")
    _require(s.batch_size >= 1, "sft.batch_size", "must be >= 1")
    _require(s.learning_rate > 0, "sft.learning_rate", "must be > 0")
    _require(g.steps >= 1, "grpo.steps", "must be >= 1")
    _require(g.prompts_per_step >= 1, "grpo.prompts_per_step", "must be >= 1")
    if g.algorithm == "reinforce":
        _require(g.group_size == 1, "grpo.group_size", "must be 1 with grpo.algorithm: reinforce (one sample per prompt)")
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
    _require(0 < g.epsilon < 1, "grpo.epsilon", "must be in (0, 1)")
    _require(g.epsilon_high is None or g.epsilon_high > 0, "grpo.epsilon_high", "must be > 0")
    _require(g.num_iterations >= 1, "grpo.num_iterations", "must be >= 1")
    _require(0 < g.reference.ema_alpha <= 1, "grpo.reference.ema_alpha", "must be in (0, 1]")
    _require(g.reference.sync_every >= 1, "grpo.reference.sync_every", "must be >= 1")
    _require(g.checkpoint_every >= 0, "grpo.checkpoint_every", "must be >= 0")
    _require(g.log_every >= 1, "grpo.log_every", "must be >= 1")
    _require(g.metrics_every >= 1, "grpo.metrics_every", "must be >= 1")
    _require(len(g.rewards) >= 1, "grpo.rewards", "needs at least one reward")
    _require(g.reward_timeout_s >= 0, "grpo.reward_timeout_s", "must be >= 0")
    _require(g.max_reward_failures >= 0, "grpo.max_reward_failures", "must be >= 0")
    _require(e.max_new_tokens >= 1, "evaluate.max_new_tokens", "must be >= 1")
    _require(e.batch_size >= 1, "evaluate.batch_size", "must be >= 1")
    _require(e.bootstrap_samples >= 100, "evaluate.bootstrap_samples", "must be >= 100")
    _validate_evaluation(cfg)
    _require(cfg.distributed.nproc >= 1, "distributed.nproc", "must be >= 1")
    _require(not (cfg.distributed.backend == "nccl" and cfg.device == "cpu"), "distributed.backend",
             "nccl needs CUDA devices; use gloo (or auto) with device: cpu")
    if cfg.distributed.strategy == "fsdp2":
        _require(cfg.distributed.nproc > 1, "distributed.strategy",
                 "fsdp2 shards the model over processes: set distributed.nproc > 1 (or use ddp)")
        _require(not cfg.grpo.lora.enabled, "distributed.strategy",
                 "fsdp2 with LoRA is not supported (LoRA's small trainable set fits DDP): use ddp")
        _require(cfg.grpo.prompts_per_step % cfg.distributed.nproc == 0, "grpo.prompts_per_step",
                 f"must be divisible by distributed.nproc ({cfg.distributed.nproc}) with fsdp2, so every "
                 "process samples the same number of groups in lockstep")
    _require(bool(cfg.register.model_name.strip()), "register.model_name", "must not be empty")
    if cfg.model.name_or_path is None:
        # word_problems' prompts are checked in real tokens by the validate stage
        longest_prompt = 0 if t.name == "word_problems" else len(
            ("What is {a} + {a}?" if t.name == "addition_question" else "{a}+{a}=").format(a=t.max_operand))
        _require(longest_prompt + g.max_completion_length <= tiny.max_position_embeddings,
                 "grpo.max_completion_length",
                 f"prompt ({longest_prompt}) + completion ({g.max_completion_length}) tokens exceed "
                 f"model.tiny.max_position_embeddings ({tiny.max_position_embeddings})")


FIXED_METRICS = ("reward", "completion_length", "eos_rate")  # the rest: pass@k, or a reward's name
PASS_AT_K = re.compile(r"pass@([1-9][0-9]*)")


def _validate_evaluation(cfg: PipelineConfig) -> None:
    """evaluate.metrics, the metric names other sections point at, and the monitors."""
    e, g, m = cfg.evaluate, cfg.grpo, cfg.monitors
    _require(len(e.metrics) >= 1, "evaluate.metrics", "needs at least one metric")
    _require(len(set(e.metrics)) == len(e.metrics), "evaluate.metrics", "lists a metric twice")
    for i, name in enumerate(e.metrics):
        _require(name in FIXED_METRICS or PASS_AT_K.fullmatch(name) is not None or ":" in name
                 or re.fullmatch(r"[a-z_]+", name) is not None, f"evaluate.metrics[{i}]",
                 f"{name!r} is not reward, completion_length, eos_rate, pass@k (k >= 1), a built-in reward's name "
                 "or package.module:function")
    ks = [int(PASS_AT_K.fullmatch(n).group(1)) for n in e.metrics if PASS_AT_K.fullmatch(n)]
    _require(e.pass_k_samples == 0 or e.pass_k_samples >= max(ks, default=1), "evaluate.pass_k_samples",
             f"must be 0 (= k) or >= the largest k ({max(ks, default=1)})")
    _require(e.pass_k_temperature > 0, "evaluate.pass_k_temperature", "must be > 0")
    _require(0 < e.pass_k_top_p <= 1, "evaluate.pass_k_top_p", "must be in (0, 1]")
    _require(e.pass_k_top_k >= 0, "evaluate.pass_k_top_k", "must be >= 0 (0 = all tokens)")
    _require(e.every >= 0, "evaluate.every", "must be >= 0 (0 = no evaluation during training)")
    _require(e.during_training_n >= 1, "evaluate.during_training_n", "must be >= 1")
    greedy = set(FIXED_METRICS) | {n for n in e.metrics if not PASS_AT_K.fullmatch(n)}
    _require(g.keep_metric in greedy, "grpo.keep_metric",
             f"{g.keep_metric!r} must be a greedy metric of evaluate.metrics ({', '.join(sorted(greedy))})")
    _require(g.keep == "last" or e.every > 0, "grpo.keep",
             "best needs held-out evaluations during training: set evaluate.every > 0")
    _require(not (g.keep == "best" and cfg.distributed.strategy == "fsdp2"), "grpo.keep",
             "best is not supported with distributed.strategy fsdp2 (the held-out evaluation runs on one process)")
    gate = cfg.register.gate_metric
    _require(gate in set(e.metrics) | {"reward"}, "register.gate_metric",
             f"{gate!r} must be one of evaluate.metrics ({', '.join(e.metrics)})")
    _require(m.window >= 1, "monitors.window", "must be >= 1")
    _require(m.evaluations >= 1, "monitors.evaluations", "must be >= 1")
    for i, check in enumerate(m.checks):
        _require((check.above is None) != (check.below is None), f"monitors.checks[{i}]",
                 f"{check.signal}: set exactly one of above or below")
    _require(m.not_learning.window >= 1, "monitors.not_learning.window", "must be >= 1")
    _require(m.no_signal.steps >= 0, "monitors.no_signal.steps", "must be >= 0 (0 = off)")
    _require(0 < m.no_signal.zero_variance_above <= 1, "monitors.no_signal.zero_variance_above", "must be in (0, 1]")
    _require(0 < m.not_learning.zero_variance_above <= 1, "monitors.not_learning.zero_variance_above",
             "must be in (0, 1]")


def config_warnings(cfg: PipelineConfig) -> list[str]:
    """Settings that run but probably do not do what their names suggest; printed before training."""
    g = cfg.grpo
    warnings = []
    if g.importance_sampling_level == "sequence" and g.loss_type != "grpo":
        warnings.append(
            f"grpo.importance_sampling_level: sequence with grpo.loss_type: {g.loss_type} is not GSPO: "
            f"{g.loss_type} sums per-token terms, so each sequence is weighted by its length; set "
            "grpo.loss_type: grpo for the GSPO paper's per-sequence objective")
    held_out = [c.signal for c in cfg.monitors.checks
                if c.signal in ("heldout_drop", "reward_heldout_gap", "heldout_flat")]
    if held_out and (cfg.evaluate.every == 0 or cfg.distributed.strategy == "fsdp2"):
        warnings.append(f"monitors {', '.join(held_out)} need held-out evaluations during training, which "
                        + ("evaluate.every: 0 turns off" if cfg.evaluate.every == 0 else
                           "do not run with distributed.strategy fsdp2") + ": they are not checked")
    return warnings


def to_flat_dict(cfg: Any, prefix: str = "") -> dict[str, Any]:
    """Flatten a config into `a.b.c -> value` for MLflow params (mappings too, so every leaf has its own
    key and secret-looking keys such as `...options.api_token` can be recognised and dropped)."""
    out: dict[str, Any] = {}
    items = ((f.name, getattr(cfg, f.name)) for f in dataclasses.fields(cfg)) if dataclasses.is_dataclass(cfg) \
        else cfg.items()
    for name, value in items:
        key = f"{prefix}{name}"
        if dataclasses.is_dataclass(value) or (isinstance(value, dict) and value):
            out.update(to_flat_dict(value, key + "."))
        elif isinstance(value, list) and value and all(dataclasses.is_dataclass(v) or isinstance(v, dict) for v in value):
            for i, item in enumerate(value):
                out.update(to_flat_dict(item, f"{key}.{i}."))
        else:
            out[key] = value
    return out


# The params each DVC stage lists in dvc.yaml (tests/test_dvc_deps.py keeps the two equal). What a stage
# keys its resumable state to is derived from the same list, so DVC re-running a stage and the stage
# refusing to resume from other inputs can never disagree.
STAGE_PARAMS: dict[str, tuple[str, ...]] = {
    "prepare": ("seed", "task", "data"),
    "model": ("seed", "model"),
    "validate": ("prompt", "model.trust_remote_code", "grpo.max_completion_length", "evaluate.max_new_tokens"),
    "sft": ("seed", "threads", "device", "prompt", "model.dtype", "model.trust_remote_code", "sft", "grpo.rewards",
            "grpo.max_completion_length", "distributed.nproc"),
    "grpo": ("seed", "threads", "device", "prompt", "model.dtype", "model.trust_remote_code", "grpo", "distributed",
             "evaluate.every", "evaluate.during_training_n", "evaluate.metrics", "evaluate.max_new_tokens", "monitors"),
    "evaluate": ("seed", "threads", "device", "prompt", "model.dtype", "model.trust_remote_code", "evaluate",
                 "grpo.rewards"),
    "register": ("seed", "prompt", "evaluate.bootstrap_samples", "evaluate.max_new_tokens", "register", "tracking"),
}


def config_value(cfg: Any, dotted: str) -> Any:
    """The config value at a dotted params key (`grpo.lora.rank`)."""
    value = cfg
    for part in dotted.split("."):
        value = getattr(value, part)
    return value


def trained_value(cfg: Any, key: str) -> Any:
    """A params value as it bears on what is trained. `distributed` reduces to whether sampling is seeded
    per group: the process count, backend and sharding change where it runs, not the result (N
    processes give one process's weights, tests/engine/test_distributed.py), so a run may resume on other hardware."""
    if key == "distributed":
        d = cfg.distributed
        return {"per_group_sampling": d.per_group_sampling or d.nproc > 1}
    return config_value(cfg, key)


def stage_params_hash(cfg: "PipelineConfig", stage: str, *inputs: Any) -> str:
    """`section_hash` of the params DVC lists for `stage` (as they bear on the result), plus input hashes."""
    return section_hash({key: trained_value(cfg, key) for key in STAGE_PARAMS[stage]}, *inputs)


# Keys that change what a run reports or watches, not the held-out reward before and after it.
NOT_IN_FINGERPRINT = {"seed", "monitors", "evaluate.every", "evaluate.during_training_n", "evaluate.metrics",
                      "evaluate.pass_k_temperature", "evaluate.pass_k_top_p", "evaluate.pass_k_top_k",
                      "evaluate.pass_k_samples", "evaluate.correct_at", "grpo.log_every", "grpo.metrics_every"}


def default_fingerprint(cfg: "PipelineConfig") -> str:
    """Hash of the params that bear on the held-out reward before and after GRPO (not the seed, the monitors
    or what is reported): a run with the fingerprint benchmarks/seed_spread.py recorded may compare itself
    with the band it measured (tests/test_config.py keeps the default's equal to the recorded one)."""
    keys = {key for stage in ("prepare", "model", "sft", "grpo", "evaluate") for key in STAGE_PARAMS[stage]}
    values = {key: dataclasses.asdict(v) if dataclasses.is_dataclass(v := config_value(cfg, key)) else v
              for key in sorted(keys - NOT_IN_FINGERPRINT)}
    for dotted in NOT_IN_FINGERPRINT:
        section, _, field_name = dotted.partition(".")
        if isinstance(values.get(section), dict):
            values[section].pop(field_name, None)
    return section_hash(values)


def section_hash(*sections: Any) -> str:
    """Stable short hash of config sections: keys resume state and lineage tags to their inputs."""
    def plain(value: Any) -> Any:
        if dataclasses.is_dataclass(value):
            return dataclasses.asdict(value)
        if isinstance(value, dict):
            return {k: plain(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [plain(v) for v in value]
        return value

    payload = json.dumps([plain(s) for s in sections], sort_keys=True, default=str)
    return hashlib.sha256(payload.encode()).hexdigest()[:16]
