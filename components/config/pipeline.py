"""The whole config (`PipelineConfig`, params.yaml key for key), `validate_config`, which runs each section's
checks and then the rules that tie sections together, and `config_warnings`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from components.config.data import DataConfig, PromptConfig, TaskConfig, check_data, check_prompt, check_task
from components.config.evaluate import EvaluateConfig, RegisterConfig, check_evaluate, check_register, greedy_metrics
from components.config.grpo import GRPOConfig, check_grpo
from components.config.model import ModelConfig, check_model
from components.config.monitors import MonitorsConfig, check_monitors
from components.config.operations import (
    DistributedConfig,
    OperationsConfig,
    ReportsConfig,
    TrackingConfig,
    check_distributed,
    check_operations,
)
from components.config.rules import _require
from components.config.sft import SFTConfig, check_sft
from components.losses import LOSSES


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


def validate_config(cfg: PipelineConfig) -> None:
    """Refuse settings that cannot work, before any data or model is touched."""
    _require(cfg.threads >= 0, "threads", "must be >= 0")
    check_task(cfg.task)
    check_model(cfg.model)
    check_data(cfg.data)
    check_prompt(cfg.prompt)
    check_sft(cfg.sft)
    check_operations(cfg.operations, cfg.tracking, cfg.reports)
    check_grpo(cfg.grpo)
    check_evaluate(cfg.evaluate)
    _check_metric_choices(cfg)
    check_monitors(cfg.monitors)
    check_distributed(cfg.distributed, cfg.device)
    if cfg.distributed.strategy == "fsdp2":
        _require(not cfg.grpo.lora.enabled, "distributed.strategy",
                 "fsdp2 with LoRA is not supported (LoRA's small trainable set fits DDP): use ddp")
        _require(cfg.grpo.prompts_per_step % cfg.distributed.nproc == 0, "grpo.prompts_per_step",
                 f"must be divisible by distributed.nproc ({cfg.distributed.nproc}) with fsdp2, so every "
                 "process samples the same number of groups in lockstep")
    episodes = bool(cfg.grpo.tools or cfg.grpo.environment)
    _require(not (episodes and cfg.distributed.strategy == "fsdp2" and cfg.distributed.nproc > 1), "grpo.tools",
             "episodes are not supported with distributed.strategy fsdp2 (each process's episodes take their own "
             "number of turns; sharded forwards need them in lockstep): use ddp")
    _require(not (episodes and cfg.prompt.chat_template == "never"), "prompt.chat_template",
             "cannot be never with grpo.tools or grpo.environment: an episode's turns are told apart by the chat "
             "template")
    _require(not (episodes and cfg.model.name_or_path is None), "grpo.tools" if cfg.grpo.tools else "grpo.environment",
             "episodes need a model whose tokenizer has a chat template, and the embedded tiny default has none: set "
             "model.name_or_path (e.g. --params configs/examples/smollm2_calculator.yaml)")
    _require(not (cfg.grpo.top_entropy_quantile < 1 and cfg.distributed.nproc > 1), "grpo.top_entropy_quantile",
             "must be 1 with several processes (distributed.nproc > 1): the entropy quantile is taken over one "
             "process's tokens only, so the masked tokens would depend on the process count")
    check_register(cfg.register)
    _check_context_length(cfg)


def _check_metric_choices(cfg: PipelineConfig) -> None:
    """The metric names grpo.keep_metric and register.gate_metric point at exist in evaluate.metrics."""
    e, g = cfg.evaluate, cfg.grpo
    greedy = greedy_metrics(e)
    _require(g.keep_metric in greedy, "grpo.keep_metric",
             f"{g.keep_metric!r} must be a greedy metric of evaluate.metrics ({', '.join(sorted(greedy))})")
    _require(g.keep == "last" or e.every > 0, "grpo.keep",
             "best needs held-out evaluations during training: set evaluate.every > 0")
    _require(not (g.keep == "best" and cfg.distributed.strategy == "fsdp2"), "grpo.keep",
             "best is not supported with distributed.strategy fsdp2 (the held-out evaluation runs on one process)")
    gate = cfg.register.gate_metric
    _require(gate in set(e.metrics) | {"reward"}, "register.gate_metric",
             f"{gate!r} must be one of evaluate.metrics ({', '.join(e.metrics)})")


def _check_context_length(cfg: PipelineConfig) -> None:
    """The tiny default's context holds the longest built-in prompt plus a completion."""
    t, g, tiny = cfg.task, cfg.grpo, cfg.model.tiny
    if cfg.model.name_or_path is None:
        # word_problems' prompts are checked in real tokens by the validate stage
        longest_prompt = 0 if t.name == "word_problems" else len(
            ("What is {a} + {a}?" if t.name == "addition_question" else "{a}+{a}=").format(a=t.max_operand))
        _require(longest_prompt + g.max_completion_length <= tiny.max_position_embeddings,
                 "grpo.max_completion_length",
                 f"prompt ({longest_prompt}) + completion ({g.max_completion_length}) tokens exceed "
                 f"model.tiny.max_position_embeddings ({tiny.max_position_embeddings})")


def config_warnings(cfg: PipelineConfig) -> list[str]:
    """Settings that run but probably do not do what their names suggest; printed before training."""
    g = cfg.grpo
    warnings = []
    minibatches = -(-g.prompts_per_step * g.group_size // (g.minibatch_size or g.prompts_per_step * g.group_size))
    one_update = g.num_iterations == 1 and (g.gradient_accumulation_steps or minibatches) >= minibatches
    loss = LOSSES[g.loss_type]
    if g.importance_sampling_level == "sequence" and not loss.per_sequence:
        warnings.append(
            f"grpo.importance_sampling_level: sequence with grpo.loss_type: {g.loss_type} is not GSPO: "
            f"{g.loss_type} sums per-token terms, so each sequence is weighted by its length; set "
            "grpo.loss_type: grpo for the GSPO paper's per-sequence objective")
    if loss.equal_on_policy_to and one_update:
        warnings.append(
            f"grpo.loss_type: {g.loss_type} with one pass and one optimizer step per rollout: the importance ratio "
            f"is exactly 1, so the update is {loss.equal_on_policy_to}'s; set "
            "grpo.num_iterations >= 2 (or several optimizer steps per rollout) for it to act")
    held_out = [c.signal for c in cfg.monitors.checks
                if c.signal in ("heldout_drop", "reward_heldout_gap", "heldout_flat")]
    if held_out and (cfg.evaluate.every == 0 or cfg.distributed.strategy == "fsdp2"):
        warnings.append(f"monitors {', '.join(held_out)} need held-out evaluations during training, which "
                        + ("evaluate.every: 0 turns off" if cfg.evaluate.every == 0 else
                           "do not run with distributed.strategy fsdp2") + ": they are not checked")
    return warnings
