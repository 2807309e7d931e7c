"""The kernel layers: the seccomp program's answers, hand-checked by running it; Landlock's presence; the refusal
to run model-written code where the kernel cannot confine it."""

from __future__ import annotations

import struct
import subprocess
import sys
from pathlib import Path

import pytest

from components.config.rules import ConfigError
from components.engine.rewards import confinement, sandbox
from components.engine.rewards.rewards import check_rewards, code_execution
from components.engine.rewards.sandbox_child import EXIT_UNCONFINED

ALLOW, EPERM, ENOSYS, KILL = 0x7FFF0000, 0x00050001, 0x00050026, 0x80000000


def _evaluate(rows, nr: int, arch: int, arg0: int = 0) -> int:
    """A classic-BPF interpreter for the four instructions the program uses, over one seccomp_data."""
    data = struct.pack("=iIQ6Q", nr, arch, 0, arg0, 0, 0, 0, 0, 0)
    accumulator, pc = 0, 0
    while True:
        code, jt, jf, k = rows[pc]
        if code == 0x20:
            accumulator = struct.unpack_from("=I", data, k)[0]
        elif code == 0x06:
            return k
        else:
            taken = {0x15: accumulator == k, 0x35: accumulator >= k, 0x45: bool(accumulator & k)}[code]
            pc += jt if taken else jf
        pc += 1


@pytest.mark.parametrize("machine,arch,calls", [
    ("x86_64", 0xC000003E, {"read": 0, "socket": 41, "socketpair": 53, "fork": 57, "execve": 59, "chmod": 90,
                            "utimensat": 280, "ptrace": 101, "clone": 56, "clone3": 435, "kill": 62, "tgkill": 234,
                            "io_uring_setup": 425, "unshare": 272, "fchmodat2": 452}),
    ("aarch64", 0xC00000B7, {"read": 63, "socket": 198, "socketpair": 199, "fork": None, "execve": 221,
                             "chmod": 53, "utimensat": 88, "ptrace": 117, "clone": 220, "clone3": 435, "kill": 129,
                             "tgkill": 131, "io_uring_setup": 425, "unshare": 97, "fchmodat2": 452}),
])
def test_seccomp_program_answers(machine, arch, calls):
    pid = 4242
    rows = confinement.seccomp_program(machine, pid)
    assert _evaluate(rows, calls["read"], arch) == ALLOW
    for name in ("socket", "socketpair", "fork", "execve", "chmod", "utimensat", "ptrace", "io_uring_setup",
                 "unshare", "fchmodat2"):
        if calls[name] is not None:
            assert _evaluate(rows, calls[name], arch) == EPERM, name
    assert _evaluate(rows, calls["clone3"], arch) == ENOSYS
    assert _evaluate(rows, calls["clone"], arch, arg0=0x00010000 | 0x100) == ALLOW  # a thread
    assert _evaluate(rows, calls["clone"], arch, arg0=0x11) == EPERM  # fork's flags: SIGCHLD
    for target, answer in ((pid, ALLOW), (0, ALLOW), ((-pid) & 0xFFFFFFFF, ALLOW), (1, EPERM), (pid + 1, EPERM),
                           (0xFFFFFFFF, EPERM)):
        assert _evaluate(rows, calls["kill"], arch, arg0=target) == answer, target
    assert _evaluate(rows, calls["tgkill"], arch, arg0=pid) == ALLOW
    assert _evaluate(rows, calls["tgkill"], arch, arg0=1) == EPERM
    assert _evaluate(rows, calls["read"], 0x40000003) == KILL  # i386's convention
    if machine == "x86_64":
        assert _evaluate(rows, 0x40000000 + 41, arch) == KILL  # x32's


def test_this_machine_can_confine():
    """The machines the suite runs on (Linux 6.x) have Landlock and a seccomp filter: the sandbox's tests are real."""
    assert confinement.landlock_abi() >= 1 and confinement.seccomp_supported()
    assert sandbox.kernel_confinement_problem() is None


def test_without_kernel_confinement_nothing_runs_unless_the_hook_alone_is_accepted(monkeypatch):
    monkeypatch.setattr(confinement, "landlock_abi", lambda: 0)
    with pytest.raises(sandbox.SandboxUnavailable, match="no Landlock"):
        sandbox.run_untrusted_python("print('never')")
    with pytest.raises(sandbox.SandboxUnavailable):
        code_execution(["p"], ["x = 1"], tests=["assert x == 1"])
    spec = type("Spec", (), {"name": "code_execution", "weight": 1.0, "options": {}})()
    with pytest.raises(ConfigError, match=r"grpo.rewards\[0\]: code_execution .*allow_hook_only"):
        check_rewards([spec])
    spec.options = {"allow_hook_only": True}
    check_rewards([spec])


@pytest.mark.parametrize("require_kernel", [True, False])
def test_the_child_runs_nothing_when_its_kernel_layers_fail(tmp_path, require_kernel):
    """The child checks for itself: where applying the layers fails there (here: made to fail), it exits
    EXIT_UNCONFINED before the code runs, or, with the hook alone accepted, says so and runs it under the hook."""
    folder = Path(sandbox.__file__).parent
    (tmp_path / "main.py").write_text("print('the code ran')\nopen('/tmp/x', 'w')\n")
    bootstrap = (f"import sys; sys.path.insert(0, {str(folder)!r}); import confinement\n"
                 "def refuse(rules):\n    raise confinement.ConfinementError('made to fail')\n"
                 "confinement.confine = refuse\nimport sandbox_child\n"
                 f"sandbox_child.run({{'require_kernel': {require_kernel}}})")
    proc = subprocess.run([sys.executable, "-I", "-S", "-c", bootstrap], cwd=tmp_path, capture_output=True,
                          text=True, timeout=60)
    if require_kernel:
        assert proc.returncode == EXIT_UNCONFINED and "the code ran" not in proc.stdout
        assert "kernel confinement unavailable: made to fail" in proc.stderr
    else:
        assert "the code ran" in proc.stdout and "audit hook alone: made to fail" in proc.stderr
        assert "writing outside the sandbox directory" in proc.stderr
