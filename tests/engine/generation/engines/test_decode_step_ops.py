"""One decode step of the CUDA-graph engine at SmolLM2's shape in bfloat16: no op waits for the device, and its op
count stays within 10% of the record (benchmarks/results/decode_step_ops.json, written by
benchmarks/decode_step_ops.py)."""

from __future__ import annotations

import json

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from benchmarks.decode_step_ops import GROWTH, RESULTS, SETTINGS, HostSync, StepOps, count_step, launching, step_engine
from components.engine.generation.engines import cuda_graphs
from components.engine.generation.engines.static_cache import distinct_index_writes


@pytest.fixture(scope="module")
def engine():
    return step_engine()


def test_the_guard_refuses_every_kind_of_host_sync():
    x = torch.arange(6.0)
    for sync in (lambda: int(x.sum()), lambda: x.max().item(), lambda: bool(x.any()), lambda: x.nonzero(),
                 lambda: x[x > 2], lambda: x.masked_select(x > 2), lambda: x.repeat_interleave(x.long()),
                 lambda: x.unique()):
        with pytest.raises(HostSync), StepOps():
            sync()
    with StepOps() as ops:  # what the step does instead: no sync
        torch.where(x > 2, x, 0.0).index_select(0, torch.tensor([1, 2]))
    assert ops.ops["where"] == 1 and ops.ops["index_select"] == 1


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_a_decode_step_never_waits_and_keeps_its_op_count(engine, setting):
    recorded = json.loads(RESULTS.read_text())["settings"][setting]
    counts = count_step(engine, SETTINGS[setting])  # raises HostSync on any sync
    total, kernels = sum(counts.values()), launching(counts)
    assert total <= recorded["total"] * (1 + GROWTH), (
        f"{total} ops a step, {recorded['total']} recorded: rerun benchmarks/decode_step_ops.py if the growth is meant")
    assert kernels <= recorded["launching"] * (1 + GROWTH), (kernels, recorded["launching"])
    assert counts["linear"] == recorded["by_op"]["linear"] == 5 * 30 + 1  # q|k|v, o, gate, up, down a layer; the head


def test_a_sync_inside_the_step_is_caught(engine, monkeypatch):
    """The guard sees what the step calls: a draw that reads a value back (as a host-side loop would) fails."""
    real = cuda_graphs.draw

    def reading_back(logits, *args):
        drawn, logp = real(logits, *args)
        if int(drawn[0]) < 0:  # a host-side decision
            raise AssertionError("unreachable")
        return drawn, logp

    monkeypatch.setattr(cuda_graphs, "draw", reading_back)
    with pytest.raises(HostSync):
        count_step(engine, SETTINGS["grpo default (temperature 1, no top-k or top-p)"])


class _DeterminismAtWrites(TorchDispatchMode):
    """Whether deterministic mode was on at each `index_copy_` dispatched inside it."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[bool] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket.__name__ == "index_copy_":
            self.seen.append(torch.are_deterministic_algorithms_enabled())
        return func(*args, **(kwargs or {}))


def test_a_decode_steps_distinct_writes_skip_deterministic_modes_sorted_path(engine, monkeypatch):
    """Under the grpo stage's deterministic mode CUDA runs `index_copy_` as a sorted `index_put_` (on an H200 the
    step's 62 writes doubled its kernels: 1,408 a token against 666, generation 15,319 against 24,936 tokens/s,
    benchmarks/results/gpu_rows.md). The step's writes have distinct indices, so they run with the mode set aside;
    the mode is back, warn-only as it was, after the step and after an error inside the guard."""
    seen = _DeterminismAtWrites()
    monkeypatch.setattr(StepOps, "__torch_dispatch__", lambda self, func, types, args=(), kwargs=None:
                        seen.__torch_dispatch__(func, types, args, kwargs))
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        count_step(engine, SETTINGS["grpo default (temperature 1, no top-k or top-p)"])
        assert torch.are_deterministic_algorithms_enabled() and torch.is_deterministic_algorithms_warn_only_enabled()
        with pytest.raises(ValueError), distinct_index_writes():
            raise ValueError("inside")
        assert torch.are_deterministic_algorithms_enabled() and torch.is_deterministic_algorithms_warn_only_enabled()
    finally:
        torch.use_deterministic_algorithms(False)
    assert len(seen.seen) == 2 * 30 + 2 and not any(seen.seen)  # k and v a layer; the token and its log-prob
