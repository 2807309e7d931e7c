"""`make`'s set-up decisions, before anything installs: an unsupported Python is refused in one line, and the torch
build follows the machine (CUDA where `nvidia-smi -L` lists a GPU, else CPU) unless TORCH= says otherwise. Real make
on a copy of the Makefile; `nvidia-smi` is a stand-in script where the test needs a GPU this machine lacks. The
install itself runs in the Quick start test."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from conftest import ROOT

FILES = ["Makefile", "requirements.lock", "constraints.txt", "pyproject.toml", "install/torch.sh"]


def other_python() -> str | None:
    """An installed Python 3.10 or 3.13 that runs (a pyenv shim without its version selected does not)."""
    candidates = [shutil.which(f"python3.{minor}") for minor in (10, 13)]
    candidates += [str(p) for p in sorted(Path.home().glob(".pyenv/versions/3.1[03]*/bin/python3.1[03]"))]
    for candidate in filter(None, candidates):
        proc = subprocess.run([candidate, "-c", "import sys; print(sys.version_info[1])"], capture_output=True,
                              text=True)
        if proc.returncode == 0 and proc.stdout.strip() in ("10", "13"):
            return candidate
    return None


def _copy(tmp_path: Path) -> Path:
    for rel in FILES:
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / rel, tmp_path / rel)
    return tmp_path


def _make(folder: Path, *args: str, gpu: bool = False) -> subprocess.CompletedProcess:
    bin_dir = folder / "fake-bin"
    bin_dir.mkdir(exist_ok=True)
    if gpu:
        (bin_dir / "nvidia-smi").write_text("#!/bin/sh\necho 'GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-0)'\n")
        (bin_dir / "nvidia-smi").chmod(0o755)
    env = {"PATH": f"{bin_dir}:/usr/local/bin:/usr/bin:/bin", "HOME": str(folder)}
    return subprocess.run(["make", *args], cwd=folder, env=env, capture_output=True, text=True, timeout=120)


def test_an_unsupported_python_is_refused_in_one_line_before_anything_installs(tmp_path):
    folder = _copy(tmp_path)
    missing = _make(folder, "run", "PYTHON=python3.9-not-here")
    assert missing.returncode != 0
    assert "python3.9-not-here does not run; grpo-pipeline needs Python 3.11 or 3.12" in missing.stderr
    python = other_python()
    if python is None:
        pytest.skip("no Python 3.10 or 3.13 on this machine for the wrong-version case")
    old = _make(folder, "run", f"PYTHON={python}")
    assert old.returncode != 0 and old.stdout == ""
    assert len(old.stderr.strip().splitlines()) == 1, old.stderr
    assert "; grpo-pipeline needs Python 3.11 or 3.12: make run PYTHON=python3.11" in old.stderr
    assert f"{python} is Python 3.1" in old.stderr
    assert not (folder / ".venv").exists()


def test_the_torch_build_follows_the_machine_unless_told(tmp_path):
    folder = _copy(tmp_path)
    assert "install/torch.sh cpu" in _make(folder, "-n", "setup").stdout
    on_gpu = _make(folder, "-n", "setup", gpu=True).stdout
    assert "install/torch.sh cuda" in on_gpu and '"an NVIDIA GPU found"' in on_gpu
    assert "install/torch.sh cpu" in _make(folder, "-n", "setup", "TORCH=cpu", gpu=True).stdout
    assert "install/torch.sh cuda" in _make(folder, "-n", "setup", "TORCH=cuda").stdout
    wrong = _make(folder, "-n", "setup", "TORCH=gpu")
    assert wrong.returncode != 0 and "TORCH=gpu: use auto, cpu or cuda" in wrong.stderr
