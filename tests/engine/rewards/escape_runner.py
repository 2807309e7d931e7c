"""Runs escape_corpus.py's attempts through the code sandbox as whoever starts it, and reports what changed outside.

Started by test_escapes.py as a separate process (as root, or as an unprivileged user), with the sandbox's
modules copied beside it: standard library only. For every attempt it lays the targets anew (files and
directories of the running user, world-writable where the sandbox would run as `nobody`, so that only the
sandbox's layers stand between the code and them), runs the attempt, and compares: every target's bytes, mode,
owner, times and inode and every directory's listing; connections or datagrams on its listeners; whether the
canary process and this process were signalled; the secret in the attempt's output; processes left behind.
Prints one JSON object: the outcome per attempt. `--layers none` runs a few attempts with no sandbox at all, to
show that these checks see an escape.
"""

from __future__ import annotations

import argparse
import json
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

from escape_corpus import ATTEMPTS

NOBODY = 65534
SECRET_TEXT = "canary-secret-7f3a91"
CONTROL_ATTEMPTS = ("open_write", "remove", "chmod", "read_home_secret", "tcp_connect", "udp_dns_query",
                    "kill_a_process_of_the_user", "signal_the_parent")
signals_received: list[int] = []


def _lay_targets(base: str, shared: bool) -> dict[str, str]:
    """The files and directories the attempts aim at, made anew (`shared`: writable and readable by others)."""
    home, project = os.path.join(base, "home"), os.path.join(base, "project")
    for path in (home, project):
        shutil.rmtree(path, ignore_errors=True)
        os.mkdir(path)
        os.chmod(path, 0o777 if shared else 0o700)
    targets = {"home": home, "project": project, "victim": os.path.join(home, "victim.txt"),
               "secret": os.path.join(home, "secret.txt"), "empty_dir": os.path.join(home, "empty"),
               "tree": os.path.join(home, "tree")}
    writable, readable = (0o666, 0o644) if shared else (0o600, 0o600)
    for path, text, mode in ((targets["victim"], "victim text\n", writable),
                             (targets["secret"], SECRET_TEXT + "\n", readable),
                             (os.path.join(project, "params.yaml"), f"token: {SECRET_TEXT}\n", readable)):
        with open(path, "w") as fh:
            fh.write(text)
        os.chmod(path, mode)
    os.mkdir(targets["empty_dir"])
    os.mkdir(targets["tree"])
    for name in ("a.txt", "b.txt"):
        with open(os.path.join(targets["tree"], name), "w") as fh:
            fh.write(name)
    for path in (targets["empty_dir"], targets["tree"]):
        os.chmod(path, 0o777 if shared else 0o700)
    return targets


def _snapshot(base: str) -> dict[str, tuple]:
    """Every path under `base` (sockets left out): kind, bytes, mode, owner, times, inode."""
    state: dict[str, tuple] = {}
    for folder, dirs, files in os.walk(base):
        st = os.lstat(folder)
        state[folder] = ("dir", tuple(sorted(dirs + files)), st.st_mode, st.st_uid, st.st_gid, st.st_mtime_ns)
        for name in files:
            path = os.path.join(folder, name)
            st = os.lstat(path)
            if not os.path.isfile(path) or os.path.islink(path):
                state[path] = ("other", st.st_mode)
                continue
            try:
                with open(path, "rb") as fh:
                    data = fh.read()
            except PermissionError:  # chmod-ed away by an escape: its mode differs anyway
                data = None
            state[path] = ("file", data, st.st_mode, st.st_uid, st.st_gid, st.st_mtime_ns, st.st_ino)
    return state


class Listeners:
    """A TCP and a UDP socket on 127.0.0.1 and two Unix sockets (a path, an abstract name), all non-blocking."""

    def __init__(self, base: str):
        self.tcp = socket.socket()
        self.tcp.bind(("127.0.0.1", 0))
        self.tcp.listen(8)
        self.udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.udp.bind(("127.0.0.1", 0))
        self.unix_path = os.path.join(base, "canary.sock")
        self.unix = socket.socket(socket.AF_UNIX)
        self.unix.bind(self.unix_path)
        os.chmod(self.unix_path, 0o777)
        self.unix.listen(8)
        self.unix_abstract = f"\0grpo-canary-{os.getpid()}"
        self.abstract = socket.socket(socket.AF_UNIX)
        self.abstract.bind(self.unix_abstract)
        self.abstract.listen(8)
        for sock in (self.tcp, self.udp, self.unix, self.abstract):
            sock.setblocking(False)

    def fields(self) -> dict[str, object]:
        return {"tcp_port": self.tcp.getsockname()[1], "udp_port": self.udp.getsockname()[1],
                "unix_path": self.unix_path, "unix_abstract": self.unix_abstract}

    def heard(self) -> list[str]:
        """What reached a listener since the last call: 'tcp', 'udp', 'unix', 'abstract' once per event. Asked once
        the attempt's processes are gone (the sandbox kills its group): what they sent is queued by then, so the
        question waits for nothing."""
        heard = []
        ready, _, _ = select.select([self.tcp, self.udp, self.unix, self.abstract], [], [], 0)
        for sock in ready:
            try:
                if sock is self.udp:
                    sock.recvfrom(4096)
                    heard.append("udp")
                else:
                    sock.accept()[0].close()
                    heard.append({self.tcp: "tcp", self.unix: "unix", self.abstract: "abstract"}[sock])
            except OSError:
                pass
        return heard


def _start_canary(as_nobody: bool) -> subprocess.Popen:
    """A sleeping process of the user the sandbox runs as, in a process group of its own."""
    def drop() -> None:
        if as_nobody:
            os.setgroups([])
            os.setgid(NOBODY)
            os.setuid(NOBODY)
    return subprocess.Popen([sys.executable, "-I", "-S", "-c", "import time; time.sleep(600)"],
                            start_new_session=True, preexec_fn=drop)


# A SIGKILL sent by another process lands asynchronously: right after the sender exits, the target may not have died
# yet on a loaded machine, and an escape that killed it would be read as refused. Attempts aimed at the canary wait
# this long for it to end (an ended canary returns at once).
CANARY_WAIT_S = 0.5


def _still_running(proc: subprocess.Popen, wait_s: float) -> bool:
    """Whether `proc` is still running after waiting up to `wait_s` seconds for it to end."""
    try:
        proc.wait(timeout=wait_s)
    except subprocess.TimeoutExpired:
        return True
    return False


def _sandbox_processes(uid: int) -> list[int]:
    """Processes of `uid` still running the sandbox's child (its command line names it; a fork keeps it)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            if os.stat(f"/proc/{entry}").st_uid != uid:
                continue
            with open(f"/proc/{entry}/cmdline", "rb") as fh:
                if b"sandbox_child" in fh.read():
                    found.append(int(entry))
        except OSError:
            continue
    return found


def _run_unsandboxed(code: str) -> tuple[bool, str]:
    """The control: the same code as a plain process of this user."""
    workdir = tempfile.mkdtemp(prefix="escape-control-")
    try:
        proc = subprocess.run([sys.executable, "-I", "-S", "-c", code], cwd=workdir, capture_output=True, text=True,
                              timeout=20)
        return proc.returncode == 0, proc.stdout + proc.stderr
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", choices=("all", "kernel", "none"), default="all")
    args = parser.parse_args()
    from components.engine.rewards.sandbox import run_untrusted_python

    signal.signal(signal.SIGTERM, lambda number, frame: signals_received.append(number))
    is_root = os.geteuid() == 0
    sandbox_uid = NOBODY if is_root else os.geteuid()
    base = tempfile.mkdtemp(prefix="escape-targets-")
    os.chmod(base, 0o755)
    listeners = Listeners(base)
    canary = _start_canary(as_nobody=is_root)
    report: dict[str, dict] = {}
    names = CONTROL_ATTEMPTS if args.layers == "none" else tuple(ATTEMPTS)
    try:
        for name in names:
            targets = _lay_targets(base, shared=is_root)
            before = _snapshot(base)
            fields = {**targets, **listeners.fields(), "canary_pid": canary.pid, "secret_text": SECRET_TEXT}
            code = ATTEMPTS[name].format(**fields)
            started = time.monotonic()
            if args.layers == "none":
                passed, output = _run_unsandboxed(code)
                reason = ""
            else:
                result = run_untrusted_python(code, timeout_s=5, memory_mb=512, audit_hook=args.layers == "all")
                passed, reason, output = result.passed, result.reason, result.stdout + result.stderr
            after = _snapshot(base)
            changed = sorted(path for path in set(before) | set(after) if before.get(path) != after.get(path))
            canary_alive = _still_running(canary, CANARY_WAIT_S if "{canary_pid}" in ATTEMPTS[name] else 0.0)
            if not canary_alive:
                canary = _start_canary(as_nobody=is_root)
            report[name] = {"passed": passed, "reason": reason[:300], "changed": changed,
                            "leaked": SECRET_TEXT in output, "network": listeners.heard(),
                            "signals": list(signals_received), "canary_alive": canary_alive,
                            "left_behind": _sandbox_processes(sandbox_uid),
                            "seconds": round(time.monotonic() - started, 2)}
            signals_received.clear()
    finally:
        canary.kill()
        shutil.rmtree(base, ignore_errors=True)
    print(json.dumps(report))


if __name__ == "__main__":
    main()
