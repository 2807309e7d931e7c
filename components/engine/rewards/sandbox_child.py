"""The sandbox's child process: confine itself, install the audit hook, then run the untrusted code.

Started by `sandbox.run_untrusted_python` as `python -I -S -c <bootstrap>` in the sandbox directory, with this
file, confinement.py and audit_guard.py copied beside it (under `_sandbox/`) and imported as top-level modules:
standard library only. The order is the contract: the kernel layers (confinement.py) first, then the audit hook
(audit_guard.py), then the code in `main.py`, compiled and run as `__main__` in a module of its own, so that
nothing of the untrusted code runs before both layers are in place. When the kernel layers cannot be applied,
the child exits with `EXIT_UNCONFINED` before running anything, unless the parent allowed the hook alone.
"""

from __future__ import annotations

import json
import os
import sys
import sysconfig

EXIT_UNCONFINED = 71  # EX_OSERR: the kernel layers could not be applied and were required
SYSTEM_READABLE = ("/usr", "/lib", "/lib64", "/lib32", "/libx32", "/etc/ld.so.cache", "/etc/localtime",
                   "/dev/urandom", "/dev/random", "/dev/zero")
WRITABLE_FILES = ("/dev/null",)


def readable_paths() -> tuple[str, ...]:
    """What the code may read besides its own directory: this interpreter's standard library (wherever it is
    installed, a home directory included: only those directories, not their parents) and the system's shared
    libraries and a few device files; each resolved through symlinks, missing ones left out."""
    stdlib = {sysconfig.get_path(name) for name in ("stdlib", "platstdlib")}
    dynload = os.path.join(sysconfig.get_path("platstdlib"), "lib-dynload")
    paths = [os.path.realpath(p) for p in (*sorted(stdlib), dynload, *SYSTEM_READABLE)]
    return tuple(dict.fromkeys(p for p in paths if os.path.exists(p)))


def run(policy: dict) -> None:
    """Confine, guard, run `main.py` of the current directory; `policy["require_kernel"]` decides what a kernel
    without the layers means (exit `EXIT_UNCONFINED`, or go on with the hook alone and say so on stderr);
    `policy["audit_hook"]` false leaves the hook out (the tests' way to show the kernel layers hold alone)."""
    import builtins
    import types

    from audit_guard import make_guard
    from confinement import READ, READ_WRITE, WRITE_FILE, ConfinementError, confine

    root = os.path.realpath(os.getcwd())
    readable = readable_paths()
    rules = {**{path: READ for path in readable}, **{path: READ | WRITE_FILE for path in WRITABLE_FILES},
             root: READ_WRITE}
    with open(os.path.join(root, "main.py"), encoding="utf-8") as fh:
        source = fh.read()
    try:
        confine(rules)
    except ConfinementError as err:
        if policy.get("require_kernel", True):
            sys.stderr.write(f"sandbox: kernel confinement unavailable: {err}\n")
            sys.stderr.flush()
            os._exit(EXIT_UNCONFINED)
        sys.stderr.write(f"sandbox: running with the audit hook alone: {err}\n")
    if policy.get("audit_hook", True):
        sys.addaudithook(make_guard(root, readable, WRITABLE_FILES))
    code = compile(source, os.path.join(root, "main.py"), "exec")
    module = types.ModuleType("__main__")
    module.__file__ = os.path.join(root, "main.py")
    module.__builtins__ = builtins
    sys.modules["__main__"] = module
    exec(code, module.__dict__)  # noqa: S102 - the untrusted code, confined above: what the sandbox is for


if __name__ == "__main__":
    run(json.loads(sys.argv[1]))
