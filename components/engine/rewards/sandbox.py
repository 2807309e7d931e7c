"""Run untrusted Python (model output) in a separate, limited process.

Layers, each independent of the others:
- a fresh temporary directory as cwd and HOME, an environment with nothing inherited (no secrets);
- rlimits: CPU seconds, address space, file size, open files and process count;
- when running as root: a fresh network namespace (no interfaces but a down loopback) and the
  `nobody` user, so the process can neither reach the network nor write outside its directory;
- always: a Python audit hook, installed before the untrusted code runs and impossible to remove,
  that refuses sockets, ctypes, subprocesses, writes outside the sandbox directory and /proc reads
  (the fallback where namespaces are unavailable);
- a wall-clock timeout that kills the whole process group.
"""

from __future__ import annotations

import ctypes
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass

CLONE_NEWNET = 0x40000000
NOBODY = 65534

_GUARD = r'''
import os as _os, sys as _sys
_ROOT = _os.path.realpath(_os.getcwd())
def _guard(event, args):
    if event.startswith(("socket.", "ctypes.", "subprocess.", "os.fork", "os.exec", "os.posix_spawn", "os.system",
                         "os.spawn", "pty.", "winreg.")) and event not in ("socket.gethostname",):
        raise PermissionError(f"sandbox: {event} is not allowed")
    if event == "open":
        path, mode = str(args[0]), str(args[1] if len(args) > 1 and args[1] is not None else "r")
        real = _os.path.realpath(path) if not path.isdigit() else path
        if real.startswith("/proc"):
            raise PermissionError("sandbox: /proc is not readable")
        if any(flag in mode for flag in "wax+") and not (real == _ROOT or real.startswith(_ROOT + _os.sep)):
            raise PermissionError(f"sandbox: writing outside the sandbox directory ({path}) is not allowed")
_sys.addaudithook(_guard)
del _guard
'''


@dataclass
class SandboxResult:
    """Outcome of one untrusted run; `reason` says why it did not pass."""

    passed: bool
    returncode: int | None
    reason: str
    stdout: str
    stderr: str


def _limit(cpu_s: int, memory_mb: int, file_mb: int, max_procs: int, isolate_net: bool, drop_user: bool):
    def apply() -> None:
        os.setsid()
        if isolate_net:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.unshare(CLONE_NEWNET)  # best effort: stays on the host network only if this fails (not root)
        resource.setrlimit(resource.RLIMIT_CPU, (cpu_s, cpu_s))
        resource.setrlimit(resource.RLIMIT_AS, (memory_mb << 20, memory_mb << 20))
        resource.setrlimit(resource.RLIMIT_FSIZE, (file_mb << 20, file_mb << 20))
        resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))
        resource.setrlimit(resource.RLIMIT_NPROC, (max_procs, max_procs))
        if drop_user:
            os.setgroups([])
            os.setgid(NOBODY)
            os.setuid(NOBODY)
    return apply


def _interpreter(drop_user: bool) -> tuple[str, bool]:
    """A Python the sandbox user can execute: the system one when dropping to `nobody`.

    The project's own interpreter often lives under a private home directory; untrusted code needs
    only the standard library anyway. Without a world-executable Python, privileges are kept and the
    audit hook and rlimits remain the guard.
    """
    if drop_user:
        for candidate in ("/usr/bin/python3", "/usr/local/bin/python3"):
            if os.path.exists(candidate) and os.stat(os.path.realpath(candidate)).st_mode & 0o001:
                return candidate, True
    return sys.executable, False


def run_untrusted_python(code: str, timeout_s: float = 5.0, memory_mb: int = 512, file_mb: int = 1,
                         max_procs: int = 16) -> SandboxResult:
    """Run `code` with limits; passed means exit status 0 within the time limit."""
    is_root = os.geteuid() == 0
    python, drop_user = _interpreter(is_root)
    workdir = tempfile.mkdtemp(prefix="grpo-sandbox-")
    try:
        os.chmod(workdir, 0o777 if is_root else 0o700)
        script = os.path.join(workdir, "main.py")
        with open(script, "w", encoding="utf-8") as fh:
            fh.write(_GUARD + "\n" + code + "\n")
        os.chmod(script, 0o644)
        env = {"PATH": "/usr/bin:/bin", "HOME": workdir, "TMPDIR": workdir, "LANG": "C.UTF-8",
               "PYTHONDONTWRITEBYTECODE": "1", "PYTHONIOENCODING": "utf-8"}
        proc = subprocess.Popen([python, "-I", "-S", script], cwd=workdir, env=env, stdin=subprocess.DEVNULL,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                preexec_fn=_limit(int(timeout_s) + 1, memory_mb, file_mb, max_procs,
                                                  isolate_net=is_root, drop_user=drop_user))
        try:
            out, err = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            out, err = proc.communicate()
            return SandboxResult(False, None, f"timed out after {timeout_s:g}s", out[-2000:], err[-2000:])
        finally:
            _kill_group(proc)  # stragglers a fork may have left behind
        if proc.returncode == 0:
            return SandboxResult(True, 0, "passed", out[-2000:], err[-2000:])
        return SandboxResult(False, proc.returncode, _explain(proc.returncode, err), out[-2000:], err[-2000:])
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _explain(code: int, stderr: str) -> str:
    if code < 0:
        name = signal.Signals(-code).name
        return f"killed by {name}" + (" (CPU time limit)" if name == "SIGXCPU" else "")
    last = next((line for line in reversed(stderr.strip().splitlines()) if line.strip()), "")
    return f"exit {code}: {last[:300]}"
