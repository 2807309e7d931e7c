"""torch.distributed plumbing for the training stages: launch, process group, rank-0-only side effects.

A stage with `distributed.nproc > 1` that is not already under torchrun re-launches itself through
`python -m torch.distributed.run --standalone --nproc_per_node=N -m components.stages.<stage>`, with the
validated config written to a temporary params file. Under torchrun (WORLD_SIZE set, e.g. a
multi-node `torchrun --rdzv-endpoint=...` started by the user) it joins the process group instead:
gloo on CPU, NCCL on CUDA. With one process nothing here touches torch.distributed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from components.config import DistributedConfig, PipelineConfig
from components.engine.generation.rollouts import Rollouts


@dataclass(frozen=True)
class DistContext:
    """This process's place in the job; `world == 1` means plain single-process training."""

    rank: int = 0
    world: int = 1
    local_rank: int = 0
    device: torch.device = torch.device("cpu")
    strategy: str = "ddp"  # distributed.strategy: ddp | fsdp2

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def lockstep(self) -> bool:
        """FSDP2: every forward all-gathers weights, so all ranks must make the same forward calls."""
        return self.active and self.strategy == "fsdp2"

    @property
    def active(self) -> bool:
        return self.world > 1


def under_torchrun() -> bool:
    """True inside a process started by torchrun (or any launcher that sets the env:// variables)."""
    return "WORLD_SIZE" in os.environ and "RANK" in os.environ


def needs_launch(d: DistributedConfig) -> bool:
    return d.nproc > 1 and not under_torchrun()


def launch(module: str, cfg: PipelineConfig, root: Path) -> None:
    """Run `python -m module` under torchrun with `cfg` on `nproc` local processes; raise on failure.

    The config travels as a params file so the workers see exactly the validated settings, overrides
    included; the workers run in `root`, the stage's repository root.
    """
    import yaml

    from components.errors import StageFailed

    n = cfg.distributed.nproc
    with tempfile.TemporaryDirectory(prefix="grpo-dist-") as tmp:
        params = Path(tmp) / "params.yaml"
        params.write_text(yaml.safe_dump(dataclasses.asdict(cfg), sort_keys=False))
        # torchrun's log folder (the workers' error files) inside this one: by default torchrun makes a
        # torchelastic_* folder in the temporary directory and leaves it there after every run.
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={n}",
               f"--log-dir={Path(tmp) / 'torchrun'}", "-m", module, "--params", str(params)]
        print(f"{module.rsplit('.', 1)[-1]}: launching {n} processes: {' '.join(cmd[1:])}", flush=True)
        code = subprocess.call(cmd, cwd=str(root.resolve()))
    if code != 0:
        raise StageFailed(f"{module}: torchrun with {n} processes exited {code} (see the worker output above)")


def init(d: DistributedConfig, fallback_device: torch.device) -> DistContext:
    """Join the process group when under torchrun; otherwise the single-process context."""
    if not under_torchrun() or int(os.environ["WORLD_SIZE"]) == 1:
        return DistContext(device=fallback_device)
    import torch.distributed as dist

    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if fallback_device.type == "cuda":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    backend = d.backend if d.backend != "auto" else ("nccl" if device.type == "cuda" else "gloo")
    if not dist.is_initialized():
        dist.init_process_group(backend=backend, device_id=device if backend == "nccl" else None)
    return DistContext(rank=dist.get_rank(), world=dist.get_world_size(), local_rank=local_rank, device=device,
                       strategy=d.strategy)


def shutdown(ctx: DistContext) -> None:
    if ctx.active:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()


def barrier(ctx: DistContext) -> None:
    if ctx.active:
        import torch.distributed as dist

        dist.barrier()


def all_gather_objects(ctx: DistContext, obj: Any) -> list[Any]:
    """Every rank's `obj`, in rank order (tensors inside should be on the CPU)."""
    if not ctx.active:
        return [obj]
    import torch.distributed as dist

    out: list[Any] = [None] * ctx.world
    dist.all_gather_object(out, obj)
    return out


def all_reduce_sum(ctx: DistContext, values: list[float]) -> list[float]:
    """Element-wise sum of `values` over ranks (float64, so logged sums match one process closely)."""
    if not ctx.active:
        return list(values)
    import torch.distributed as dist

    t = torch.tensor(values, dtype=torch.float64, device=ctx.device)
    dist.all_reduce(t)
    return t.tolist()


def all_true(ctx: DistContext, flag: bool) -> bool:
    """True when `flag` holds on every rank (a MIN all-reduce); lets ranks stop a loop together."""
    if not ctx.active:
        return flag
    import torch.distributed as dist

    t = torch.tensor([1 if flag else 0], dtype=torch.int32, device=ctx.device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return bool(t.item())


def shard(items: list[Any], ctx: DistContext) -> list[Any]:
    """This rank's share, round-robin: item k goes to rank k % world."""
    return items[ctx.rank::ctx.world]


def group_seed(seed: int, step: int, attempt: int, position: int) -> int:
    """A sampler seed for one prompt group, a pure function of where the group sits in the global batch.

    Keyed by (seed, step, sampling round, position in the step's prompt list), never by rank, so a
    group draws the same completions however many processes share the batch.
    """
    digest = hashlib.sha256(f"{seed}:{step}:{attempt}:{position}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def wrap_ddp(model: torch.nn.Module, ctx: DistContext) -> torch.nn.Module:
    """DDP over the trainable parameters (gradients averaged over ranks on backward); identity alone."""
    if not ctx.active:
        return model
    from torch.nn.parallel import DistributedDataParallel

    ids = [ctx.device.index] if ctx.device.type == "cuda" else None
    return DistributedDataParallel(model, device_ids=ids)


@contextlib.contextmanager
def no_sync(module: torch.nn.Module, skip: bool) -> Iterator[None]:
    """DDP's no_sync while `skip` (gradient accumulation: reduce only on the last micro-batch)."""
    if skip and hasattr(module, "no_sync"):
        with module.no_sync():
            yield
    else:
        yield


def full_value(value: Any) -> Any:
    """A DTensor's full value (FSDP2 shards a gradient norm too); anything else as it is."""
    return value.full_tensor() if hasattr(value, "full_tensor") else value


def zero_loss_backward(logprobs: Callable[[Rollouts], torch.Tensor], module: torch.nn.Module, row: Rollouts,
                       last: bool) -> None:
    """A process with no group in a minibatch backpropagates a zero loss through one row (`logprobs` with a
    gradient goes through DDP's wrapper `module`), so DDP's gradient collective still matches the other processes'."""
    with no_sync(module, skip=not last):
        (torch.nan_to_num(logprobs(row)).sum() * 0.0).backward()
