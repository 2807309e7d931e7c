"""The code sandbox against escape_corpus.py, as root and as an unprivileged user: every target outside unchanged.

Each run is a separate process (escape_runner.py) as the user named, with the sandbox's modules copied where that
user can read them; the unprivileged user is a uid with no other process, made for the test when the suite runs
as root (the suite run by an unprivileged user runs that case as itself and skips the root one). Both layers
together, and the kernel layers alone (the audit hook left out), so that neither is the only thing that holds.
A control runs some attempts with no sandbox and must see each of them change its target: the checks can fail.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from components.engine.rewards.sandbox import kernel_confinement_problem
from tests.engine.rewards.escape_corpus import ATTEMPTS

ROOT = Path(__file__).resolve().parents[3]
HERE = Path(__file__).resolve().parent
UNPRIVILEGED_UID = 54321  # a uid with no account and no process: its files and processes are the test's alone
SANDBOX_FILES = ("components/__init__.py", "components/quiet.py", "components/engine/__init__.py",
                 "components/engine/rewards/__init__.py", "components/engine/rewards/sandbox.py",
                 "components/engine/rewards/sandbox_child.py", "components/engine/rewards/confinement.py",
                 "components/engine/rewards/audit_guard.py")
IS_ROOT = os.geteuid() == 0
pytestmark = pytest.mark.skipif(kernel_confinement_problem() is not None,
                                reason=f"no kernel confinement here: {kernel_confinement_problem()}")


def _python() -> str:
    """A Python every user may run (the project's own may sit in a private home directory)."""
    for candidate in ("/usr/bin/python3", "/usr/local/bin/python3"):
        if os.path.exists(candidate) and os.stat(os.path.realpath(candidate)).st_mode & 0o001:
            return candidate
    if not IS_ROOT:
        return sys.executable
    pytest.skip("no Python that every user may run (/usr/bin/python3) for the unprivileged user")


def _run_corpus(layers: str, as_uid: int | None) -> dict[str, dict]:
    """escape_runner.py's report, run as `as_uid` (None: as this process's user)."""
    folder = Path(tempfile.mkdtemp(prefix="escape-runner-"))
    try:
        os.chmod(folder, 0o755)
        for name in SANDBOX_FILES:
            (folder / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(ROOT / name, folder / name)
        for name in ("escape_corpus.py", "escape_runner.py"):
            shutil.copyfile(HERE / name, folder / name)
        for path in [folder, *folder.rglob("*")]:
            os.chmod(path, 0o755 if path.is_dir() else 0o644)
        home = Path(tempfile.mkdtemp(prefix="escape-home-"))

        def become() -> None:
            if as_uid is not None:
                os.setgroups([])
                os.setgid(as_uid)
                os.setuid(as_uid)
        if as_uid is not None:
            os.chown(home, as_uid, as_uid)
        env = {"PATH": "/usr/bin:/bin", "HOME": str(home), "LANG": "C.UTF-8", "PYTHONPATH": str(folder),
               "PYTHONDONTWRITEBYTECODE": "1"}
        proc = subprocess.run([_python(), str(folder / "escape_runner.py"), "--layers", layers], cwd=home, env=env,
                              capture_output=True, text=True, timeout=600, preexec_fn=become)
        assert proc.returncode == 0, f"the runner died (exit {proc.returncode}):\n{proc.stderr[-3000:]}"
        return json.loads(proc.stdout.strip().splitlines()[-1])
    finally:
        shutil.rmtree(folder, ignore_errors=True)
        shutil.rmtree(home, ignore_errors=True)


def _escapes(report: dict[str, dict]) -> dict[str, dict]:
    """The attempts that did anything outside, or ran to the end."""
    return {name: outcome for name, outcome in report.items()
            if outcome["passed"] or outcome["changed"] or outcome["leaked"] or outcome["network"]
            or outcome["signals"] or not outcome["canary_alive"] or outcome["left_behind"]}


def test_the_corpus_has_every_family():
    assert len(ATTEMPTS) >= 25
    for family in ("remove", "rename", "replace_onto", "truncate", "chmod", "chown", "utime", "hard_link_then_write",
                   "symlink_then_write", "mkdir", "rmdir", "rmtree", "os_open_write_trunc", "read_home_secret",
                   "read_project", "rebind_through_sys_modules", "ctypes_through_importlib", "signal_the_parent",
                   "fork_bomb", "memory_bomb", "tcp_connect", "udp_dns_query", "dns_lookup", "urllib"):
        assert family in ATTEMPTS


@pytest.mark.skipif(not IS_ROOT, reason="the suite runs as an unprivileged user: the root case needs root")
@pytest.mark.parametrize("layers", ["all", "kernel"])
def test_nothing_escapes_as_root(layers):
    report = _run_corpus(layers, as_uid=None)
    assert set(report) == set(ATTEMPTS)
    assert _escapes(report) == {}


@pytest.mark.parametrize("layers", ["all", "kernel"])
def test_nothing_escapes_as_an_unprivileged_user(layers):
    report = _run_corpus(layers, as_uid=UNPRIVILEGED_UID if IS_ROOT else None)
    assert set(report) == set(ATTEMPTS)
    assert _escapes(report) == {}


def test_the_checks_see_each_escape_without_a_sandbox():
    report = _run_corpus("none", as_uid=UNPRIVILEGED_UID if IS_ROOT else None)
    assert report["open_write"]["changed"] and report["remove"]["changed"] and report["chmod"]["changed"]
    assert report["read_home_secret"]["leaked"]
    assert report["tcp_connect"]["network"] == ["tcp"] and report["udp_dns_query"]["network"] == ["udp"]
    assert not report["kill_a_process_of_the_user"]["canary_alive"]
    assert report["signal_the_parent"]["signals"]
