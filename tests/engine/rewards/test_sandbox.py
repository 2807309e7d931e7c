"""Hostile model output in the code-execution sandbox: each case scores 0 with its reason; the host is unharmed."""

import os
import socket
import time

import pytest

from components.engine.rewards.sandbox import run_untrusted_python


def test_passing_and_failing_code():
    assert run_untrusted_python("assert sum(range(4)) == 6").passed
    failed = run_untrusted_python("assert 1 == 2, 'nope'")
    assert not failed.passed and "AssertionError: nope" in failed.reason


def test_infinite_loop_is_killed_on_time():
    started = time.monotonic()
    result = run_untrusted_python("while True:\n    pass", timeout_s=2)
    assert not result.passed and "timed out after 2s" in result.reason
    assert time.monotonic() - started < 6


def test_memory_bomb_hits_the_address_space_limit():
    result = run_untrusted_python("block = bytearray(4 * 1024 ** 3)", memory_mb=256)
    assert not result.passed and "MemoryError" in result.reason


def test_fork_bomb_is_refused():
    result = run_untrusted_python("import os\nwhile True:\n    os.fork()", timeout_s=3)
    assert not result.passed and "os.fork is not allowed" in result.reason


def test_writing_outside_its_directory_is_refused(tmp_path):
    target = tmp_path / "escaped.txt"
    os.chmod(tmp_path, 0o777)
    result = run_untrusted_python(f"open({str(target)!r}, 'w').write('x')")
    assert not result.passed and "writing outside the sandbox directory" in result.reason
    assert not target.exists()
    assert run_untrusted_python("open('inside.txt', 'w').write('x')\nassert open('inside.txt').read() == 'x'").passed


def test_environment_secrets_are_not_visible(monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_TOKEN", "s3cr3t")
    result = run_untrusted_python("import os\nprint(sorted(os.environ))\n"
                                  "assert 'MLFLOW_TRACKING_TOKEN' not in os.environ")
    assert result.passed and "s3cr3t" not in result.stdout
    proc = run_untrusted_python("import os\nprint(open(f'/proc/{os.getppid()}/environ').read())")
    assert not proc.passed and "s3cr3t" not in proc.stdout


def test_sockets_are_refused():
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    port = server.getsockname()[1]
    server.settimeout(0.5)
    result = run_untrusted_python(f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=1)")
    assert not result.passed and "socket" in result.reason
    with pytest.raises(socket.timeout):
        server.accept()  # nothing connected
    server.close()


def test_too_large_file_hits_the_file_size_limit():
    result = run_untrusted_python("open('big.bin', 'wb').write(b'0' * (8 << 20))", file_mb=1)
    assert not result.passed
