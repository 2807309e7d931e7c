"""Ctrl-C's reach: the CLI finds the running stage's launcher among its descendants, also below an intermediate
process (a shell, the flow's runner), and never picks the stage server. Real processes, walked with psutil."""

from __future__ import annotations

import subprocess
import sys
import time

import psutil

from pipelines.interrupts import stage_launchers

SLEEP = "import time; time.sleep(60)"


def _spawn(*argv: str) -> subprocess.Popen:
    # argv after `-c CODE` lands in the command line as it would for `python -m components.runtime.launch grpo`
    return subprocess.Popen([sys.executable, "-c", SLEEP, *argv])


def test_the_launcher_is_found_below_an_intermediate_process_and_the_stage_server_is_not():
    nested = ("import subprocess, sys; p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)', "
              "'-m', 'components.runtime.launch', 'grpo']); p.wait()")
    procs = [subprocess.Popen([sys.executable, "-c", nested]),
             _spawn("-m", "components.runtime.stage_server", "--socket", "x"),
             _spawn("-m", "pipelines.cli")]
    try:
        deadline = time.time() + 30
        while time.time() < deadline and not stage_launchers():
            time.sleep(0.05)
        found = stage_launchers()
        assert len(found) == 1, found
        launcher = psutil.Process(found[0])
        assert launcher.cmdline()[-2:] == ["components.runtime.launch", "grpo"]
        assert launcher.ppid() == procs[0].pid  # a grandchild: the walk goes below the first level
    finally:
        for proc in procs:
            for child in psutil.Process(proc.pid).children(recursive=True):
                child.kill()
            proc.kill()
            proc.wait()


def test_a_process_without_children_has_no_launchers():
    proc = _spawn()
    try:
        assert stage_launchers(proc.pid) == []
    finally:
        proc.kill()
        proc.wait()
