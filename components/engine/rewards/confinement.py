"""Kernel confinement of the sandbox's child process: Landlock for files, TCP and signals, seccomp for the rest.

Applied by the child to itself (`sandbox_child.py`) after its interpreter started and before the untrusted code
runs; both are inherited by anything it could start and neither can be lifted again, by root included. Both work
for an unprivileged user (they need only `no_new_privs`, set here). Standard library only: the child runs
`python -I -S`, with no site packages.

- Landlock (Linux 5.13+, `landlock_abi() >= 1`): the process may read only the paths given as readable (the
  interpreter's standard library, the system's shared libraries, a few device files) and read and write only its
  own directory; it may execute nothing. Linux 6.2+ (ABI 3) also refuses truncating files elsewhere, 6.7+ (ABI 4)
  refuses TCP connect and bind, 6.12+ (ABI 6) refuses signals to processes outside the sandbox and abstract Unix
  sockets. Landlock does not cover metadata changes (chmod, chown, utime, extended attributes): seccomp does.
- seccomp (x86_64 and aarch64): refuses creating sockets of any family (so UDP and DNS too), new processes (fork,
  vfork, clone without CLONE_THREAD; clone3 answers ENOSYS so the C library falls back to clone), exec, every
  chmod/chown/utime/xattr call, io_uring (which can open sockets past the socket filter), ptrace, namespaces,
  mounts, keyrings, BPF, perf and handle-based opens, and signals to any process but its own. A call of another
  architecture's convention kills the process.
"""

from __future__ import annotations

import ctypes
import os
import platform
import struct

# Landlock's system calls have the same numbers on every architecture.
_SYS_LANDLOCK_CREATE_RULESET, _SYS_LANDLOCK_ADD_RULE, _SYS_LANDLOCK_RESTRICT_SELF = 444, 445, 446
_LANDLOCK_CREATE_RULESET_VERSION = 1
_LANDLOCK_RULE_PATH_BENEATH = 1
_PR_SET_NO_NEW_PRIVS, _PR_SET_SECCOMP, _SECCOMP_MODE_FILTER = 38, 22, 2

# Landlock's filesystem rights, by the ABI that introduced them.
EXECUTE, WRITE_FILE, READ_FILE, READ_DIR = 1 << 0, 1 << 1, 1 << 2, 1 << 3
REMOVE_DIR, REMOVE_FILE, MAKE_CHAR, MAKE_DIR = 1 << 4, 1 << 5, 1 << 6, 1 << 7
MAKE_REG, MAKE_SOCK, MAKE_FIFO, MAKE_BLOCK, MAKE_SYM = 1 << 8, 1 << 9, 1 << 10, 1 << 11, 1 << 12
REFER, TRUNCATE, IOCTL_DEV = 1 << 13, 1 << 14, 1 << 15
_FS_RIGHTS_BY_ABI = {1: (1 << 13) - 1, 2: (1 << 14) - 1, 3: (1 << 15) - 1, 4: (1 << 15) - 1, 5: (1 << 16) - 1}
_FILE_ONLY_RIGHTS = EXECUTE | WRITE_FILE | READ_FILE | TRUNCATE | IOCTL_DEV
_NET_BIND_TCP, _NET_CONNECT_TCP = 1, 2  # ABI 4
_SCOPE_ABSTRACT_UNIX_SOCKET, _SCOPE_SIGNAL = 1, 2  # ABI 6

READ = READ_FILE | READ_DIR
READ_WRITE = READ | WRITE_FILE | REMOVE_DIR | REMOVE_FILE | MAKE_DIR | MAKE_REG | TRUNCATE | REFER


class ConfinementError(RuntimeError):
    """The kernel refused or lacks a layer; the process must not run untrusted code."""


def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    return libc


def landlock_abi() -> int:
    """The running kernel's Landlock ABI version, 0 where it has none (not Linux, before Linux 5.13, disabled)."""
    if platform.system() != "Linux":
        return 0
    version = _libc().syscall(ctypes.c_long(_SYS_LANDLOCK_CREATE_RULESET), None, ctypes.c_size_t(0),
                              ctypes.c_uint32(_LANDLOCK_CREATE_RULESET_VERSION))
    return max(int(version), 0)


def seccomp_supported() -> bool:
    """Whether this module has a seccomp filter for this machine's architecture."""
    return platform.system() == "Linux" and platform.machine() in _SECCOMP_ARCH


def _check(result: int, what: str) -> int:
    if result < 0:
        raise ConfinementError(f"{what} failed: {os.strerror(ctypes.get_errno())}")
    return result


def restrict_filesystem(rules: dict[str, int], abi: int) -> None:
    """Landlock: handle every right the kernel knows (so all are refused) and allow each path only its rights.

    `rules` maps a path to its rights (READ, READ_WRITE, ...); a missing path is skipped; a file gets only the
    rights that apply to files. Needs `no_new_privs` (set by `confine`)."""
    libc = _libc()
    handled_fs = _FS_RIGHTS_BY_ABI.get(abi, _FS_RIGHTS_BY_ABI[5])
    attr = struct.pack("=QQQ", handled_fs, _NET_BIND_TCP | _NET_CONNECT_TCP if abi >= 4 else 0,
                       _SCOPE_ABSTRACT_UNIX_SOCKET | _SCOPE_SIGNAL if abi >= 6 else 0)
    size = 24 if abi >= 6 else 16 if abi >= 4 else 8
    buffer = ctypes.create_string_buffer(attr[:size], size)
    ruleset = _check(libc.syscall(ctypes.c_long(_SYS_LANDLOCK_CREATE_RULESET), buffer, ctypes.c_size_t(size),
                                  ctypes.c_uint32(0)), "landlock_create_ruleset")
    try:
        for path, rights in rules.items():
            try:
                fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
            except FileNotFoundError:
                continue
            try:
                allowed = rights & handled_fs
                if not os.path.isdir(path):
                    allowed &= _FILE_ONLY_RIGHTS
                rule = ctypes.create_string_buffer(struct.pack("=Qi", allowed, fd), 12)
                _check(libc.syscall(ctypes.c_long(_SYS_LANDLOCK_ADD_RULE), ctypes.c_int(ruleset),
                                    ctypes.c_int(_LANDLOCK_RULE_PATH_BENEATH), rule, ctypes.c_uint32(0)),
                       f"landlock_add_rule({path})")
            finally:
                os.close(fd)
        _check(libc.syscall(ctypes.c_long(_SYS_LANDLOCK_RESTRICT_SELF), ctypes.c_int(ruleset), ctypes.c_uint32(0)),
               "landlock_restrict_self")
    finally:
        os.close(ruleset)


# Per architecture: its audit number, and the numbers of the calls refused with EPERM.
_X86_64_REFUSED = (41, 53, 57, 58, 59, 322, 90, 91, 268, 92, 93, 94, 260, 132, 235, 261, 280, 188, 189, 190, 197, 198,
                   199, 425, 101, 129, 297, 434, 424, 438, 272, 308, 165, 310, 311, 250, 248, 249, 321, 298, 323,
                   303, 304)
_AARCH64_REFUSED = (198, 199, 221, 281, 52, 53, 54, 55, 88, 5, 6, 7, 14, 15, 16, 425, 117, 138, 240, 434, 424, 438,
                    97, 268, 40, 270, 271, 219, 217, 218, 280, 241, 282, 264, 265)
_NEWER_REFUSED = (452, 463, 466)  # fchmodat2, setxattrat, removexattrat: the same numbers everywhere
_SECCOMP_ARCH = {
    # machine: (AUDIT_ARCH, refused, clone, clone3, kill, tkill, tgkill, first number of another ABI or None)
    "x86_64": (0xC000003E, _X86_64_REFUSED + _NEWER_REFUSED, 56, 435, 62, 200, 234, 0x40000000),
    "aarch64": (0xC00000B7, _AARCH64_REFUSED + _NEWER_REFUSED, 220, 435, 129, 130, 131, None),
}
_RET_KILL_PROCESS, _RET_ERRNO, _RET_ALLOW = 0x80000000, 0x00050000, 0x7FFF0000
_EPERM, _ENOSYS = 1, 38
_CLONE_THREAD = 0x00010000
_LD_W_ABS, _JEQ, _JGE, _JSET, _RET = 0x20, 0x15, 0x35, 0x45, 0x06
_NR, _ARCH, _ARG0 = 0, 4, 16  # offsets in struct seccomp_data (arguments are little-endian 64-bit)


def seccomp_program(machine: str, pid: int) -> list[tuple[int, int, int, int]]:
    """The BPF program as (code, jt, jf, k) rows: what `confine` loads for `machine`, signals allowed to `pid`."""
    audit_arch, refused, clone, clone3, kill, tkill, tgkill, other_abi = _SECCOMP_ARCH[machine]
    deny, allow = (_RET, 0, 0, _RET_ERRNO | _EPERM), (_RET, 0, 0, _RET_ALLOW)
    rows = [(_LD_W_ABS, 0, 0, _ARCH), (_JEQ, 1, 0, audit_arch), (_RET, 0, 0, _RET_KILL_PROCESS),
            (_LD_W_ABS, 0, 0, _NR)]
    if other_abi is not None:
        rows += [(_JGE, 0, 1, other_abi), (_RET, 0, 0, _RET_KILL_PROCESS)]
    for number in refused:
        rows += [(_JEQ, 0, 1, number), deny]
    rows += [(_JEQ, 0, 1, clone3), (_RET, 0, 0, _RET_ERRNO | _ENOSYS)]
    # clone: threads only.
    rows += [(_JEQ, 0, 4, clone), (_LD_W_ABS, 0, 0, _ARG0), (_JSET, 0, 1, _CLONE_THREAD), allow, deny]
    # kill: itself, its own process group (0 or -pid) only; tkill and tgkill: its own thread group only.
    rows += [(_JEQ, 0, 6, kill), (_LD_W_ABS, 0, 0, _ARG0), (_JEQ, 3, 0, pid), (_JEQ, 2, 0, 0),
             (_JEQ, 1, 0, (-pid) & 0xFFFFFFFF), deny, allow]
    for number in (tkill, tgkill):
        rows += [(_JEQ, 0, 4, number), (_LD_W_ABS, 0, 0, _ARG0), (_JEQ, 1, 0, pid), deny, allow]
    return rows + [allow]


def restrict_syscalls(pid: int) -> None:
    """seccomp: load `seccomp_program` for this machine. Needs `no_new_privs` (set by `confine`)."""
    rows = seccomp_program(platform.machine(), pid)
    program = b"".join(struct.pack("=HBBI", *row) for row in rows)
    filters = ctypes.create_string_buffer(program, len(program))
    fprog = ctypes.create_string_buffer(struct.pack("@HP", len(rows), ctypes.addressof(filters)))
    _check(_libc().prctl(ctypes.c_int(_PR_SET_SECCOMP), ctypes.c_ulong(_SECCOMP_MODE_FILTER), fprog, ctypes.c_ulong(0),
                        ctypes.c_ulong(0)), "seccomp filter")


def unavailable() -> str | None:
    """Why these layers cannot apply on this machine, or None when they can."""
    if landlock_abi() < 1:
        return "the kernel has no Landlock (Linux 5.13 or newer with Landlock enabled is needed)"
    if not seccomp_supported():
        return f"no seccomp filter for the {platform.machine()} architecture (x86_64 and aarch64 have one)"
    return None


def confine(rules: dict[str, int]) -> int:
    """Apply every kernel layer to this process; the Landlock ABI it ran with. Raises ConfinementError (and
    applies nothing) where `unavailable` says why they cannot apply."""
    if problem := unavailable():
        raise ConfinementError(problem)
    abi = landlock_abi()
    zero = ctypes.c_ulong(0)
    _check(_libc().prctl(ctypes.c_int(_PR_SET_NO_NEW_PRIVS), ctypes.c_ulong(1), zero, zero, zero),
           "prctl(PR_SET_NO_NEW_PRIVS)")
    restrict_filesystem(rules, abi)
    restrict_syscalls(os.getpid())
    return abi
