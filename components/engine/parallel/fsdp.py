"""FSDP2 (`torch.distributed.fsdp.fully_shard`) for models too large for one GPU: shard, gather, save, resume.

Each decoder layer is one FSDP unit and the root (embeddings, final norm, head) another, so a rank
holds 1/N of the weights, gradients and AdamW state, and all-gathers one layer at a time in every
forward. That makes every forward a collective: the callers run them in lockstep (engine/grpo/batch.py
per_group_round, engine/grpo/update.py policy_updates). Checkpoints stay in the single-process format (full
weights in safetensors, an optimizer state keyed by parameter index), gathered to rank 0, so a run
resumes with any process count and either strategy.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from components.engine.parallel.distributed import DistContext


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The transformer blocks: the ModuleList holding `config.num_hidden_layers` modules (any HF decoder)."""
    n = getattr(getattr(model, "config", None), "num_hidden_layers", None)
    for module in model.modules():
        if isinstance(module, torch.nn.ModuleList) and len(module) > 0 and (n is None or len(module) == n):
            return list(module)
    return []


def shard_model(model: torch.nn.Module, ctx: DistContext) -> torch.nn.Module:
    """`fully_shard` every decoder layer, then the root, over all ranks; the module is changed in place.

    The model may sit on the CPU: fully_shard moves each unit to `ctx.device` as it shards it, so a
    GPU never holds more than its shards plus one whole layer.
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(ctx.device.type, (ctx.world,))
    for layer in decoder_layers(model):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def is_sharded(model: Any) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


def full_model_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """All weights gathered onto rank 0's CPU (an empty dict elsewhere); every rank must call it."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def trainable_names(model: torch.nn.Module) -> list[str]:
    """Parameter names in optimizer order (the order `[p for p in model.parameters() if p.requires_grad]`)."""
    return [name for name, p in model.named_parameters() if p.requires_grad]


def full_optimizer_state(model: torch.nn.Module, optimizer) -> dict[str, Any]:
    """The optimizer state gathered to rank 0, keyed by parameter index like `optimizer.state_dict()`."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    osd = get_optimizer_state_dict(model, optimizer,
                                   options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if not osd:
        return {}
    index = {name: i for i, name in enumerate(trainable_names(model))}
    return {"state": {index[k]: v for k, v in osd["state"].items()},
            "param_groups": [{**group, "params": [index[k] for k in group["params"]]} for group in osd["param_groups"]]}


def load_optimizer_state(model: torch.nn.Module, optimizer, saved: dict[str, Any]) -> None:
    """Shard a full, index-keyed optimizer state (every rank passes the same) into this rank's optimizer."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    names = trainable_names(model)
    osd = {"state": {names[int(i)]: v for i, v in saved["state"].items()},
           "param_groups": [{**group, "params": [names[int(i)] for i in group["params"]]}
                            for group in saved["param_groups"]]}
    set_optimizer_state_dict(model, optimizer, optim_state_dict=osd, options=StateDictOptions(full_state_dict=True))


class HeldOptimizerState:
    """Stands in for an optimizer in `save_checkpoint`/`load_checkpoint`: holds a full, index-keyed state.

    Resume reads the checkpoint into an unsharded model before sharding; the optimizer (built over the
    sharded parameters afterwards) then takes the held state through `load_optimizer_state`.
    """

    def __init__(self, state: dict[str, Any] | None = None):
        self.state = state or {}

    def state_dict(self) -> dict[str, Any]:
        return self.state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.state = state


def plain_copy(load_plain: Callable[[], torch.nn.Module], state: dict[str, torch.Tensor]) -> torch.nn.Module:
    """An unsharded CPU model holding `state`, so the usual savers write the usual files."""
    model = load_plain()
    model.load_state_dict(state, assign=True)  # no second copy of the weights in memory ...
    if hasattr(model, "tie_weights"):  # ... but assigning unties shared tensors (embeddings = head): re-tie
        model.tie_weights()
    return model


def save_sharded_checkpoint(root: Path, step: int, run_hash: str, model, optimizer, state: dict[str, Any],
                            reference, load_plain: Callable[[], torch.nn.Module], ctx: DistContext) -> None:
    """`save_checkpoint` for sharded models: every rank gathers, rank 0 writes the single-process format."""
    from components.data.checkpoints import save_checkpoint

    weights = full_model_state(model)
    ref_weights = full_model_state(reference) if reference is not None else None
    saved_optimizer = full_optimizer_state(model, optimizer)
    if ctx.is_main:
        save_checkpoint(root, step, run_hash, plain_copy(load_plain, weights), HeldOptimizerState(saved_optimizer),
                        state, plain_copy(load_plain, ref_weights) if ref_weights is not None else None)
