"""How much memory a GRPO step needs, estimated from the model's shape and the step's settings, before it runs.

`fit_memory` uses it when the policy is built: to turn gradient checkpointing on where `auto` says so, to warn (with
the knobs that lower it) when the estimate exceeds the memory the machine has free, and to pick the allocator setting
(`host_memory.configure_allocator`) from the step's largest activation. The figures are float32 bytes on the CPU
(half that per value for bfloat16 on a GPU); the benchmark `benchmarks/long_completions.py` prints each estimate
beside the measured peak.

Per decoder layer and token, a training forward keeps about `ACTIVATION_WIDTHS` values for backward (inputs of
the norms, q|k|v, rotated q|k, attention output, residuals, gate, up, their product): 10 x hidden + 4 x
intermediate. With gradient checkpointing only each layer's input is kept, plus one layer's worth while it is
recomputed. Attention adds the probabilities of each completion row over its prompt and itself.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import psutil
import torch

from components.config import GRPOConfig
from components.engine.generation.logprobs import LOGITS_BUDGET_BYTES, LOGITS_CHUNK_BYTES
from components.engine.grpo.host_memory import configure_allocator

GiB = 2**30
ACTIVATION_WIDTHS = (10, 4)  # values kept per token and layer: x hidden size, x intermediate size
RUNTIME_BYTES = 1.0 * GiB  # Python, torch, transformers and the tokenizer, resident before any tensor


@dataclass(frozen=True)
class ModelShape:
    """What the estimate needs of a model: its config's sizes and its parameter counts."""

    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    parameters: int
    trainable: int

    @classmethod
    def of(cls, model: Any) -> ModelShape:
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        c = base.config
        heads = c.num_attention_heads
        return cls(layers=c.num_hidden_layers, hidden=c.hidden_size,
                   intermediate=getattr(c, "intermediate_size", 4 * c.hidden_size), heads=heads,
                   kv_heads=getattr(c, "num_key_value_heads", None) or heads,
                   head_dim=getattr(c, "head_dim", None) or c.hidden_size // heads, vocab=c.vocab_size,
                   parameters=sum(p.numel() for p in model.parameters()),
                   trainable=sum(p.numel() for p in model.parameters() if p.requires_grad))


@dataclass(frozen=True)
class StepMemory:
    """Estimated bytes: resident throughout (weights, optimizer state) and the larger of the step's two phases."""

    weights: float
    optimizer: float
    generation: float
    update: float
    largest_activation: float  # the largest single tensor of a training forward (drives the allocator choice)

    @property
    def peak(self) -> float:
        return RUNTIME_BYTES + self.weights + self.optimizer + max(self.generation, self.update)

    def text(self) -> str:
        return (f"{self.peak / GiB:.1f} GB (weights {self.weights / GiB:.1f}, optimizer {self.optimizer / GiB:.1f}, "
                f"sampling {self.generation / GiB:.1f}, update {self.update / GiB:.1f})")


def estimate_step_memory(shape: ModelShape, g: GRPOConfig, prompt_tokens: int, reference_copy: bool,
                         bytes_per_value: int = 4) -> StepMemory:
    """The estimate for completions of `g.max_completion_length` tokens after prompts of `prompt_tokens`."""
    b, length = bytes_per_value, g.max_completion_length
    rows = g.prompts_per_step * g.group_size
    rows_per_forward = g.minibatch_size or rows
    prompts_per_forward = max(1, rows_per_forward // g.group_size)
    weights = shape.parameters * b * (2 if reference_copy else 1)
    optimizer = shape.trainable * b * 3  # gradient, AdamW's two moments
    # sampling: every row's KV cache at full length, one row of logits and its sampling buffers
    generation = shape.layers * 2 * rows * shape.kv_heads * shape.head_dim * (prompt_tokens + length) * b \
        + rows * shape.vocab * 16
    tokens = rows_per_forward * length + prompts_per_forward * prompt_tokens
    per_token_layer = (ACTIVATION_WIDTHS[0] * shape.hidden + ACTIVATION_WIDTHS[1] * shape.intermediate) * b
    attention_layer = rows_per_forward * shape.heads * length * (prompt_tokens + length) * b
    if g.gradient_checkpointing == "always":
        activations = shape.layers * tokens * shape.hidden * b + tokens * per_token_layer + 3 * attention_layer
    else:
        activations = shape.layers * (tokens * per_token_layer + attention_layer)
    logits_rows = rows_per_forward * length
    logits = 3 * (logits_rows * shape.vocab * 4 if logits_rows * shape.vocab * 4 <= LOGITS_BUDGET_BYTES
                  else LOGITS_CHUNK_BYTES)
    update = activations + logits + tokens * shape.hidden * b * 2  # the gradient of the layer being run
    return StepMemory(weights, optimizer, generation, update, largest_activation=tokens * shape.intermediate * b)


def knobs(g: GRPOConfig) -> str:
    """The settings that lower a step's memory, from the cheapest in time."""
    hints = []
    if g.gradient_checkpointing != "always":
        hints.append("grpo.gradient_checkpointing=always")
    rows = g.minibatch_size or g.prompts_per_step * g.group_size
    if rows > g.group_size:
        hints.append(f"grpo.minibatch_size={max(g.group_size, rows // 2 // g.group_size * g.group_size)}")
    hints.append(f"a shorter grpo.max_completion_length (now {g.max_completion_length})")
    if not g.lora.enabled:
        hints.append("grpo.lora.enabled=true")
    return ", ".join(hints)


AUTO_CHECKPOINTING_SHARE = 0.5  # `gradient_checkpointing: auto` turns it on above this share of the free memory


@dataclass(frozen=True)
class MemoryFit:
    """A step's estimate as it will run, whether training forwards recompute each layer, and what lowers it."""

    memory: StepMemory
    gradient_checkpointing: bool
    knobs: str


def fit_memory(g: GRPOConfig, model: Any, prompt_tokens: int, reference_copy: bool,
               say: Callable[..., None] = print) -> MemoryFit:
    """Estimate the step's memory before the first step (prompts of `prompt_tokens`, a reference copy or not): turn
    gradient checkpointing on where `grpo.gradient_checkpointing: auto` says so, pick the allocator setting, and
    warn, with the knobs that lower it, when it still exceeds the free memory."""
    shape = ModelShape.of(model)
    value_bytes = next(model.parameters()).element_size()
    device = next(model.parameters()).device
    # the memory the step's tensors live in: the GPU's own on CUDA, the host's otherwise
    available = torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else psutil.virtual_memory().available
    checkpointing = g.gradient_checkpointing == "always"
    memory = estimate_step_memory(shape, g, prompt_tokens, reference_copy, value_bytes)
    if g.gradient_checkpointing == "auto" and memory.peak > AUTO_CHECKPOINTING_SHARE * available:
        checkpointing = True
        say(f"grpo: gradient checkpointing on (grpo.gradient_checkpointing: auto): a step needs an estimated "
            f"{memory.peak / GiB:.1f} GB without it, over half the {available / GiB:.1f} GB free", flush=True)
    settled = replace(g, gradient_checkpointing="always" if checkpointing else "never")
    memory = estimate_step_memory(shape, settled, prompt_tokens, reference_copy, value_bytes)
    configure_allocator(memory.largest_activation)
    if memory.peak > available:
        say(f"grpo: warning: a step at max_completion_length {g.max_completion_length} needs an estimated "
            f"{memory.text()}, more than the {available / GiB:.1f} GB free on {device.type}; lower it with "
            f"{knobs(settled)}", flush=True)
    return MemoryFit(memory, checkpointing, knobs(settled))
