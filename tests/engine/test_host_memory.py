"""glibc keeps freed memory for the next step: a large tensor allocated after a larger one was freed
takes no new pages (no page faults), where glibc's default maps and faults in fresh pages each time."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# Frees 200 MB, then counts the page faults of touching a 100 MB tensor (24,414 pages of 4 KiB).
CHILD = """
import resource, sys, torch
sys.path.insert(0, {root!r})
from components.engine.host_memory import keep_freed_memory
set_up = keep_freed_memory() if {keep} else None
x = torch.ones(50_000_000); del x
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
x = torch.ones(25_000_000); del x
print(set_up, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _faults(keep: bool) -> tuple[str, int]:
    out = subprocess.run([sys.executable, "-c", CHILD.format(root=str(ROOT), keep=keep)], check=True,
                         capture_output=True, text=True).stdout.split()
    return out[0], int(out[1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the setting is glibc's (Linux)")
def test_freed_memory_is_reused_without_page_faults():
    set_up, kept = _faults(keep=True)
    _, default = _faults(keep=False)
    assert set_up == "True"
    assert default > 20_000, "glibc's default should fault the 100 MB tensor's pages in"
    assert kept < 1_000, f"{kept} page faults: the freed 200 MB was not reused"


def test_the_grpo_stage_process_keeps_freed_memory(monkeypatch, tmp_path):
    from components.stages import grpo

    calls = []
    monkeypatch.setattr(grpo, "keep_freed_memory", lambda: calls.append(True))
    assert grpo.main(["--params", str(tmp_path / "missing.yaml")]) == 1  # stops at the params; the setting came first
    assert calls == [True]
