"""The sandbox's second layer: a Python audit hook that refuses, by name, what the kernel layer also refuses.

`make_guard` builds the hook from the sandbox's directory and the paths it may read. Its decisions depend on
nothing the untrusted code can rebind: every name a decision uses (builtins, constants, the paths, its helpers)
is bound as a default argument when the hook is made, so the functions read no module global and no builtin at
call time, and have no closure cells (tests/engine/rewards/test_audit_guard.py reads their bytecode); the
defaults tuple itself cannot be replaced (`__defaults__`, `__code__` and `__kwdefaults__` assignments are refused,
as are the `gc` calls that would find the hook; any function's `__code__` and this module's functions'
defaults). It calls no method of an object the code made: a path that is
not exactly `str`, `bytes` or an `int` descriptor is refused without looking at it (so `pathlib.Path.open` is
refused; `open(str(path))` works).

What it refuses:
- sockets, DNS, URL and mail clients, ctypes (its import included), new processes (fork, exec, spawn, subprocess,
  pty), signals (`os.kill`, `os.killpg`, `signal.pthread_kill`), raising resource limits, changing directory;
- every path-changing call (open for writing by mode or flags, remove, unlink, rmdir, rename, replace, mkdir,
  truncate, shutil's tree and copy calls) whose path is outside the sandbox directory, is relative to a directory
  descriptor, or climbs with `..`; symlinks and hard links anywhere; chmod, chown, utime, chflags and extended
  attributes anywhere;
- reading (open, listdir, scandir) anything but the sandbox directory and the readable paths it was given
  (`/proc`, the user's home and the project are therefore refused); `os.open` only inside the sandbox directory
  (so no directory descriptor outside it can be had for the `dir_fd` calls the hook cannot see).
Paths are compared as written (relative ones against the sandbox directory, which the code cannot leave), not
resolved through symlinks: that is the kernel layer's job (confinement.py), which resolves every path itself.
"""

from __future__ import annotations

import os
from collections.abc import Callable

REFUSED_EVENT_PREFIXES = (
    "socket.", "ctypes.", "subprocess.", "os.fork", "os.forkpty", "os.exec", "os.posix_spawn", "os.system",
    "os.spawn", "os.startfile", "os.kill", "os.killpg", "os.chdir", "os.chflags", "os.lchflags", "os.chmod",
    "os.chown", "os.utime", "os.link", "os.symlink", "os.setxattr", "os.removexattr", "os.add_dll_directory",
    "pty.", "urllib.", "http.", "ftplib.", "smtplib.", "poplib.", "imaplib.", "nntplib.", "telnetlib.",
    "webbrowser.", "signal.pthread_kill", "resource.setrlimit", "resource.prlimit", "gc.get_objects",
    "gc.get_referrers", "gc.get_referents", "sys.addaudithook", "shutil.chown", "shutil.copymode", "shutil.copystat",
    "shutil.make_archive", "_winapi.", "winreg.", "msvcrt.",
)
ALLOWED_EVENTS = frozenset({"socket.gethostname"})
GUARDED_ATTRIBUTES = frozenset({"__code__", "__defaults__", "__kwdefaults__"})
# (event, positions of the paths it changes, positions of directory descriptors that must be unset): tuples, so
# that nothing the code can reach (this module's globals included) can change what the hook decides.
PATH_CHANGES = (
    ("os.remove", (0,), (1,)), ("os.rmdir", (0,), (1,)), ("os.rename", (0, 1), (2, 3)), ("os.mkdir", (0,), (2,)),
    ("os.truncate", (0,), ()), ("shutil.rmtree", (0,), (1,)), ("shutil.copyfile", (1,), ()),
    ("shutil.copytree", (1,), ()), ("shutil.move", (0, 1), ()), ("shutil.unpack_archive", (1,), ()),
)
PATH_READS = ("os.listdir", "os.scandir", "os.fwalk", "os.walk", "os.getxattr", "os.listxattr", "glob.glob",
              "glob.glob/2")  # the path is the first argument
WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
WRITE_MODE_LETTERS = ("w", "a", "x", "+")


def _text(path: object, _type=type, _str=str, _bytes=bytes, _decode=bytes.decode) -> str | None:
    """The path as an exact str, or None for anything else (never calling a method of the object)."""
    kind = _type(path)
    if kind is _str:
        return path
    if kind is _bytes:
        return _decode(path, "utf-8", "surrogateescape")
    return None


def _inside(path: str, prefixes: tuple[str, ...], exact: tuple[str, ...], root_prefix: str) -> bool:
    """Whether `path`, as written (relative to the sandbox directory), lies in one of the trees."""
    full = path if path.startswith("/") else root_prefix + path
    if "\x00" in full or "/../" in full + "/" or full.startswith("../"):
        return False
    return full in exact or full.startswith(prefixes)


_FUNCTION = type(_text)
_OWN_FILE = _text.__code__.co_filename


def make_guard(write_root: str, read_paths: tuple[str, ...],
               writable_files: tuple[str, ...] = ()) -> Callable[[str, tuple], None]:
    """The audit hook for a sandbox whose directory is `write_root` (already resolved), that may also read
    `read_paths` and write the files `writable_files` (`/dev/null`), each resolved."""
    root = write_root.rstrip("/")
    root_prefix = root + "/"
    read_exact = tuple(p.rstrip("/") for p in read_paths + writable_files) + (root,)
    read_prefixes = tuple(p.rstrip("/") + "/" for p in read_paths) + (root_prefix,)
    write_exact, write_prefixes = (root, *writable_files), (root_prefix,)

    def guard(event, args, _refused=REFUSED_EVENT_PREFIXES, _allowed=ALLOWED_EVENTS, _changes=PATH_CHANGES,
              _reads=PATH_READS, _guarded=GUARDED_ATTRIBUTES, _write_flags=WRITE_FLAGS, _letters=WRITE_MODE_LETTERS,
              _text=_text, _inside=_inside, _type=type, _int=int, _str=str, _len=len, _error=PermissionError,
              _root_prefix=root_prefix, _read_exact=read_exact, _read_prefixes=read_prefixes,
              _write_exact=write_exact, _write_prefixes=write_prefixes, _function=_FUNCTION,
              _own_file=_OWN_FILE):
        if event in _allowed:
            return
        if event.startswith(_refused):
            raise _error("sandbox: " + event + " is not allowed")
        if event == "open":
            path, mode, flags = args[0], args[1], args[2]
            if _type(path) is _int:
                return
            text = _text(path)
            if text is None:
                raise _error("sandbox: open of a path that is not a str or bytes is not allowed")
            writes = (_type(flags) is _int and flags & _write_flags) or (
                _type(mode) is _str and (_letters[0] in mode or _letters[1] in mode or _letters[2] in mode
                                         or _letters[3] in mode))
            if mode is None or writes:  # os.open, or any write: only inside the sandbox directory
                if not _inside(text, _write_prefixes, _write_exact, _root_prefix):
                    raise _error("sandbox: writing outside the sandbox directory (" + text + ") is not allowed"
                                 if writes else "sandbox: os.open outside the sandbox directory (" + text
                                 + ") is not allowed")
            elif not _inside(text, _read_prefixes, _read_exact, _root_prefix):
                raise _error("sandbox: reading " + text + " is not allowed")
            return
        if event == "object.__setattr__" or event == "object.__delattr__":
            if _len(args) > 1 and _type(args[1]) is _str and args[1] in _guarded and (
                    args[1] == "__code__" or (_type(args[0]) is _function
                                              and args[0].__code__.co_filename == _own_file)):
                raise _error("sandbox: setting " + args[1] + " is not allowed here")
            return
        for name, paths, descriptors in _changes:
            if name != event:
                continue
            for position in descriptors:
                if _len(args) > position and args[position] is not None and args[position] != -1:
                    raise _error("sandbox: " + event + " relative to a directory descriptor is not allowed")
            for position in paths:
                path = args[position] if _len(args) > position else None
                if _type(path) is _int and event == "os.truncate":
                    continue  # ftruncate of a descriptor the code could only have opened for writing inside
                text = _text(path)
                if text is None or not _inside(text, _write_prefixes, _write_exact, _root_prefix):
                    raise _error("sandbox: " + event + " outside the sandbox directory is not allowed")
            return
        if event in _reads and _len(args) > 0:
            path = args[0]
            if path is None or _type(path) is _int:
                return
            text = _text(path)
            if text is None or not _inside(text, _read_prefixes, _read_exact, _root_prefix):
                raise _error("sandbox: " + event + " of " + (text or "a path that is not a str") + " is not allowed")

    return guard
