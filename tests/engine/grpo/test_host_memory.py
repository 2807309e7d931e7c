"""glibc keeps freed memory for the next step: a large tensor allocated after a larger one was freed
takes no new pages (no page faults), where glibc's default maps and faults in fresh pages each time."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]

# Frees 200 MB, then counts the page faults of touching a 100 MB tensor (24,414 pages of 4 KiB).
CHILD = """
import resource, sys, torch
sys.path.insert(0, {root!r})
from components.engine.grpo.host_memory import keep_freed_memory
set_up = keep_freed_memory() if {keep} else None
x = torch.ones(50_000_000); del x
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
x = torch.ones(25_000_000); del x
print(set_up, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _faults(keep: bool) -> tuple[str, int]:
    # 4 KiB pages, as glibc's default: the CLI's GLIBC_TUNABLES (huge pages) may be in this process's environment
    env = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"}
    out = subprocess.run([sys.executable, "-c", CHILD.format(root=str(ROOT), keep=keep)], check=True,
                         capture_output=True, text=True, env=env).stdout.split()
    return out[0], int(out[1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the setting is glibc's (Linux)")
def test_freed_memory_is_reused_without_page_faults():
    set_up, kept = _faults(keep=True)
    _, default = _faults(keep=False)
    assert set_up == "True"
    assert default > 20_000, "glibc's default should fault the 100 MB tensor's pages in"
    assert kept < 1_000, f"{kept} page faults: the freed 200 MB was not reused"


BOUNDED_CHILD = """
import psutil, sys, torch
sys.path.insert(0, {root!r})
from components.engine.grpo.host_memory import configure_allocator
mode = configure_allocator({largest})
kept = [torch.ones(2_000) for _ in range(10)]  # small live blocks between the large ones, as a layer's outputs
blocks = []
for i in range(40):  # 40 x 20 MB, each freed after the next one is made, with a small live block between
    blocks.append(torch.ones(5_000_000 + i * 1_000))
    kept.append(torch.ones(2_000))
    if len(blocks) > 1:
        del blocks[0]
del blocks
print(mode, psutil.Process().memory_info().rss // 2**20)
"""


def _rss_after_churn(largest: int) -> tuple[str, int]:
    out = subprocess.run([sys.executable, "-c", BOUNDED_CHILD.format(root=str(ROOT), largest=largest)], check=True,
                         capture_output=True, text=True).stdout.split()
    return out[0], int(out[1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the setting is glibc's (Linux)")
def test_large_activations_are_returned_to_the_system_small_ones_kept():
    """Steps whose activations stay small keep freed memory (no page faults); steps with large ones get
    `bounded`, where 800 MB of 20 MB blocks freed one after another leaves no 20 MB block resident."""
    from components.engine.grpo.host_memory import KEEP_BELOW

    keep_mode, _ = _rss_after_churn(KEEP_BELOW - 1)
    bounded_mode, bounded_rss = _rss_after_churn(KEEP_BELOW)
    assert (keep_mode, bounded_mode) == ("keep", "bounded")
    baseline = int(subprocess.run([sys.executable, "-c", "import psutil, torch; "
                                   "print(psutil.Process().memory_info().rss // 2**20)"],
                                  check=True, capture_output=True, text=True).stdout)
    assert bounded_rss < baseline + 30, f"{bounded_rss} MB resident against {baseline} MB after importing torch"


SMOLLM2_SHAPE = dict(layers=30, hidden=576, intermediate=1536, heads=9, kv_heads=3, head_dim=64, vocab=49152,
                     parameters=134_515_008)


def test_the_policy_builder_chooses_the_allocator_from_its_memory_estimate(monkeypatch):
    """The step is estimated before training and the largest activation goes to configure_allocator."""
    from components.config import PipelineConfig
    from components.engine.grpo import memory_estimate

    seen = []
    monkeypatch.setattr(memory_estimate, "configure_allocator", lambda largest: seen.append(largest) or "keep")
    monkeypatch.setattr(memory_estimate.ModelShape, "of", staticmethod(lambda model: memory_estimate.ModelShape(
        **SMOLLM2_SHAPE, trainable=134_515_008)))
    g = PipelineConfig().grpo
    g.prompts_per_step, g.group_size, g.max_completion_length = 8, 8, 256
    memory_estimate.fit_memory(g, torch.nn.Linear(1, 1), 40, False, lambda *a, **k: None)
    # 64 rows x 256 tokens + 8 prompts x 40 tokens = 16,704 tokens x 1,536 intermediate x 4 bytes
    assert seen == [16_704 * 1536 * 4]


@pytest.mark.parametrize("free_gb, expected", [(64, False), (6, True), (2, True)])
def test_auto_checkpointing_turns_on_when_a_step_would_not_fit_half_the_free_memory(monkeypatch, free_gb, expected):
    """SmolLM2-135M LoRA, 64 completions of 256 tokens: an estimated 29 GB without checkpointing, 4.1 GB with it.
    64 GB free: off; 6 GB: on, and it fits; 2 GB: on, and the warning names what else lowers it."""
    from types import SimpleNamespace

    from components.config import PipelineConfig
    from components.engine.grpo import memory_estimate

    monkeypatch.setattr(memory_estimate, "configure_allocator", lambda largest: "keep")
    monkeypatch.setattr(memory_estimate.ModelShape, "of", staticmethod(lambda model: memory_estimate.ModelShape(
        **SMOLLM2_SHAPE, trainable=4_884_480)))
    monkeypatch.setattr(memory_estimate.psutil, "virtual_memory", lambda: SimpleNamespace(available=free_gb * 2**30))
    g = PipelineConfig().grpo
    g.prompts_per_step, g.group_size, g.max_completion_length = 8, 8, 256
    said = []
    fit = memory_estimate.fit_memory(g, torch.nn.Linear(1, 1), 40, False, lambda *a, **k: said.append(a[0]))
    assert fit.gradient_checkpointing is expected
    assert any("gradient checkpointing on" in line for line in said) is expected
    warned = [line for line in said if "warning" in line]
    assert bool(warned) is (free_gb == 2)
    if warned:
        assert "grpo.minibatch_size=32" in warned[0] and "max_completion_length" in warned[0]
    assert 2.5 * 2**30 < fit.memory.peak < (5 if expected else 40) * 2**30
