"""Run untrusted Python (model output) in a separate, confined process.

Layers, each independent of the others (docs/security.md says what holds where):
- the kernel, for any user: the child confines itself before the code runs (confinement.py): Landlock lets it
  read only the interpreter's standard library and the system's libraries and write only its own directory, and
  refuses TCP and signals outside; seccomp refuses sockets, new processes, exec and metadata changes. Required:
  where the kernel cannot apply them the code does not run (`SandboxUnavailable`), unless `require_kernel=False`;
- a Python audit hook (audit_guard.py) installed after them, before the code: the same refusals by name, with
  decisions the code cannot rebind;
- a fresh temporary directory as cwd and HOME, an environment with nothing inherited (no secrets);
- rlimits: CPU seconds, address space, file size, open files and process count;
- when running as root: a fresh network namespace (no interfaces but a down loopback) and the `nobody` user;
- a wall-clock timeout that kills the whole process group.
"""

from __future__ import annotations

import ctypes
import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from components.engine.rewards import confinement
from components.engine.rewards.sandbox_child import EXIT_UNCONFINED

CLONE_NEWNET = 0x40000000
NOBODY = 65534
CHILD_FILES = ("sandbox_child.py", "confinement.py", "audit_guard.py")  # standard library only, run by the child
_BOOTSTRAP = ("import json, sys; sys.path.insert(0, {folder!r}); import sandbox_child; "
              "sandbox_child.run(json.loads(sys.argv[1]))")


class SandboxUnavailable(RuntimeError):
    """This machine's kernel cannot confine the code (no Landlock, or no seccomp filter for its architecture)."""


def kernel_confinement_problem() -> str | None:
    """Why the kernel layers cannot apply on this machine, or None when they can (checked in this process: the
    child checks again and refuses to run unconfined)."""
    return confinement.unavailable()


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
    """A Python the sandbox user can execute: the system one when dropping to `nobody`, else this one's base
    interpreter (outside any virtual environment: the code needs only the standard library).

    The project's own interpreter often lives under a private home directory. Without a world-executable
    Python, root's privileges are kept and the kernel layers, the audit hook and the rlimits remain the guard.
    """
    if drop_user:
        for candidate in ("/usr/bin/python3", "/usr/local/bin/python3"):
            if os.path.exists(candidate) and os.stat(os.path.realpath(candidate)).st_mode & 0o001:
                return candidate, True
    return os.path.realpath(getattr(sys, "_base_executable", sys.executable)), False


def run_untrusted_python(code: str, timeout_s: float = 5.0, memory_mb: int = 512, file_mb: int = 1,
                         max_procs: int = 16, require_kernel: bool = True, audit_hook: bool = True) -> SandboxResult:
    """Run `code` with limits; passed means exit status 0 within the time limit. Raises SandboxUnavailable when
    `require_kernel` and the kernel cannot confine it (nothing runs then). `audit_hook=False` leaves the second
    layer out: only for showing that the kernel layers hold alone."""
    if require_kernel and (problem := kernel_confinement_problem()):
        raise SandboxUnavailable(f"the code sandbox cannot confine model-written code here: {problem}")
    is_root = os.geteuid() == 0
    python, drop_user = _interpreter(is_root)
    workdir = os.path.realpath(tempfile.mkdtemp(prefix="grpo-sandbox-"))
    try:
        os.chmod(workdir, 0o777 if is_root else 0o700)
        script = os.path.join(workdir, "main.py")
        with open(script, "w", encoding="utf-8") as fh:
            fh.write(code + "\n")
        os.chmod(script, 0o644)
        child_folder = os.path.join(workdir, "_sandbox")
        os.mkdir(child_folder)
        for name in CHILD_FILES:
            shutil.copyfile(Path(__file__).with_name(name), os.path.join(child_folder, name))
            os.chmod(os.path.join(child_folder, name), 0o644)
        os.chmod(child_folder, 0o755)
        env = {"PATH": "/usr/bin:/bin", "HOME": workdir, "TMPDIR": workdir, "LANG": "C.UTF-8",
               "PYTHONDONTWRITEBYTECODE": "1", "PYTHONIOENCODING": "utf-8"}
        command = [python, "-I", "-S", "-c", _BOOTSTRAP.format(folder=child_folder),
                   json.dumps({"require_kernel": require_kernel, "audit_hook": audit_hook})]
        proc = subprocess.Popen(command, cwd=workdir, env=env, stdin=subprocess.DEVNULL,
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
        if proc.returncode == EXIT_UNCONFINED and "sandbox: kernel confinement unavailable" in err:
            raise SandboxUnavailable(err.strip().splitlines()[-1])
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
