"""The README's Quick start, run as written in a fresh clone of this commit."""

from __future__ import annotations

import re
import subprocess

import pytest

from conftest import ROOT

pytestmark = pytest.mark.slow


def fenced_blocks() -> list[tuple[str, str]]:
    """(language, text) of each fenced block of the README's Quick start, in order."""
    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("## Quick start"):readme.index("\n## ", readme.index("## Quick start") + 5)]
    return re.findall(r"^```(\w*)\n(.*?)^```$", section, re.S | re.M)


def quick_start_commands() -> list[str]:
    """The commands of the Quick start's bash block, comments dropped."""
    language, block = fenced_blocks()[0]
    assert language == "bash"
    return [line.split("  #")[0].strip() for line in block.splitlines() if line.strip()]


def test_the_quick_start_works_as_written(tmp_path):
    commands = quick_start_commands()
    assert commands[0].startswith("git clone ") and commands[1] == "make run" and commands[-1] == "make test"
    clone = tmp_path / "grpo-pipeline"
    subprocess.run(["git", "clone", "-q", str(ROOT), str(clone)], check=True)
    (clone / ".venv").symlink_to(ROOT / ".venv")  # installed already: `make` keeps it (-o below)
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "PREFECT_HOME": str(tmp_path / "prefect")}
    # The clone and `make test` (this suite itself) are left out; `make` is told the shared .venv is installed.
    script = "\n".join(["set -euo pipefail"] + [c.replace("make run", "make -o .venv/.installed run")
                                                 for c in commands[1:-1]])
    proc = subprocess.run(["bash", "-c", script], cwd=clone, env=env, capture_output=True, text=True, timeout=1500)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout
    # The lines the README shows at the end of the first run, in that order.
    shown = fenced_blocks()[1][1]  # the block after the commands
    starts = [line.split(":")[0] + ":" for line in shown.splitlines()]
    positions = [out.find(start) for start in starts]
    assert -1 not in positions and positions == sorted(positions), (starts, out[-3000:])
    assert "| vs its start |" in out or "vs its start" in out  # grpo-pipeline compare ran in the activated shell
    assert (clone / "params.yaml").read_bytes() == (ROOT / "params.yaml").read_bytes()  # the default, untouched
