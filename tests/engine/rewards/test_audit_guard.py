"""The audit hook's decisions, called directly with the events CPython raises, and what they may read."""

from __future__ import annotations

import dis
import os

import pytest

from components.engine.rewards import audit_guard
from components.engine.rewards.audit_guard import make_guard

ROOT = "/tmp/sandbox-dir"
STDLIB = "/usr/lib/python3.11"
guard = make_guard(ROOT, (STDLIB, "/usr"), ("/dev/null",))
WRITE = os.O_WRONLY | os.O_CREAT | os.O_TRUNC


@pytest.mark.parametrize("event,args", [
    ("open", ("inside.txt", "w", WRITE)), ("open", (ROOT + "/a/b.txt", "r", 0)), ("open", ("/dev/null", "w", WRITE)),
    ("open", (STDLIB + "/os.py", "r", 0)), ("open", (3, "w", WRITE)), ("open", ("mine", None, os.O_RDONLY)),
    ("os.remove", ("inside.txt", -1)), ("os.rename", ("a", ROOT + "/b", -1, -1)), ("os.mkdir", ("d", 511, -1)),
    ("os.truncate", (5, 0)), ("os.listdir", (None,)), ("os.scandir", (STDLIB + "/json",)),
    ("object.__setattr__", (type, "__doc__", "x")), ("socket.gethostname", ()), ("import", ("json",)),
])
def test_allowed(event, args):
    assert guard(event, args) is None  # allowed: the hook returns without raising


@pytest.mark.parametrize("event,args", [
    ("open", ("/home/user/victim", "w", WRITE)), ("open", ("/home/user/victim", None, os.O_WRONLY | os.O_TRUNC)),
    ("open", ("/home/user/victim", "r", os.O_RDONLY | os.O_TRUNC)), ("open", ("/home/user/.ssh/id_rsa", "r", 0)),
    ("open", ("/proc/1/environ", "r", 0)), ("open", ("../x", "w", WRITE)), ("open", (ROOT + "/../x", "w", WRITE)),
    ("open", (STDLIB + "/os.py", None, os.O_RDONLY)), ("open", (b"/etc/passwd", "r", 0)),
    ("open", (type("P", (str,), {})("inside"), "r", 0)), ("open", ("/usr2/x", "r", 0)),
    ("os.remove", ("/home/user/victim", -1)), ("os.remove", ("victim", 3)), ("os.rmdir", ("/home/user/d", -1)),
    ("os.rename", ("inside", "/home/user/victim", -1, -1)), ("os.rename", ("/home/user/victim", "x", -1, -1)),
    ("os.mkdir", ("/home/user/d", 511, -1)), ("os.truncate", ("/home/user/victim", 0)),
    ("shutil.rmtree", ("/home/user", None)), ("shutil.move", ("/home/user/victim", "x")),
    ("os.chmod", ("inside", 0, -1)), ("os.chown", ("inside", 0, 0, -1)), ("os.utime", ("inside", None, None, -1)),
    ("os.link", ("/home/user/victim", "x", -1, -1)), ("os.symlink", ("/home/user/victim", "x", -1)),
    ("os.chdir", ("/home/user",)), ("os.listdir", ("/home/user",)), ("os.scandir", ("/",)),
    ("socket.__new__", (None, 2, 1, 0)), ("socket.getaddrinfo", ("example.com", 80, 0, 0, 0)),
    ("urllib.Request", ("http://x", None, {}, "GET")), ("ctypes.dlopen", (None,)), ("ctypes.call_function", (0, ())),
    ("subprocess.Popen", ("sh", [], None, None)), ("os.fork", ()), ("os.exec", ("/bin/sh", [], None)),
    ("os.posix_spawn", ("/bin/sh", [], {})), ("os.system", ("ls",)), ("os.kill", (1, 9)), ("os.killpg", (1, 9)),
    ("signal.pthread_kill", (1, 9)), ("resource.setrlimit", (9, (-1, -1))), ("gc.get_objects", (None,)),
    ("gc.get_referrers", ((),)), ("sys.addaudithook", ()),
    ("object.__setattr__", (lambda: 0, "__code__", None)),
    ("object.__setattr__", (audit_guard._inside, "__defaults__", None)),
])
def test_refused(event, args):
    with pytest.raises(PermissionError, match="sandbox"):
        guard(event, args)


def test_setting_defaults_of_the_users_own_functions_is_allowed():
    assert guard("object.__setattr__", (lambda a=1: a, "__defaults__", (2,))) is None  # namedtuple does this


def _guard_functions():
    return [guard, audit_guard._text, audit_guard._inside]


def test_the_hook_reads_no_global_no_builtin_and_no_closure_at_call_time():
    """Every name its decisions use is bound as a default when made: nothing the code can rebind is looked up."""
    for fn in _guard_functions():
        assert fn.__closure__ is None, fn.__name__
        loads = {ins.opname for ins in dis.get_instructions(fn)}
        assert not loads & {"LOAD_GLOBAL", "LOAD_NAME", "LOAD_DEREF", "LOAD_CLASSDEREF", "LOAD_CLOSURE"}, fn.__name__
        for value in fn.__defaults__ or ():
            assert not isinstance(value, (dict, list, set)), f"{fn.__name__} holds a mutable default {value!r}"
