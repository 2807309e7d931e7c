"""The suite's record (benchmarks/results/test_suite.json): written only by a whole passing run that asks for it
(`make test-record`), read for the order of test files, and `make test` itself leaves the working tree as it found
it, passing, failing or interrupted. Real pytest runs (two workers, as `make test`) on small test files."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time

from conftest import ROOT

PASSING = {
    "test_quick.py": "def test_a():\n    pass\n\ndef test_b():\n    pass\n",
    "test_slow.py": "import time\n\ndef test_sleeps():\n    time.sleep(0.6)\n\ndef test_also():\n    pass\n",
}
FAILING = {"test_fails.py": "def test_fails():\n    assert False\n"}
# Touches a file so the test can send Ctrl-C while it runs.
HANGING = {"test_hangs.py": "import pathlib, time\n\ndef test_hangs():\n    pathlib.Path('started').touch()\n"
                            "    time.sleep(60)\n"}
OLD_RECORD = {"file_seconds": {"test_quick.py": 1.0, "test_slow.py": 9.0}, "note": "the committed record"}


def _write(folder, files: dict[str, str]) -> None:
    for name, text in files.items():
        (folder / name).write_text(text)


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT / "tests")}


def _pytest(folder, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "suite_timing", "-p", "no:cacheprovider",
                           "--rootdir", str(folder), *args], cwd=folder, env=_env(), capture_output=True, text=True,
                          timeout=300)


def _ctrl_c(folder, command: list[str]) -> subprocess.CompletedProcess:
    """Run `command` in `folder` and press Ctrl-C once its hanging test has started: SIGINT to the whole process
    group, as a terminal sends it to the foreground job, whose SIGINT has its default disposition (a test earlier in
    the same worker may leave it ignored, which the child would inherit: Python then never raises KeyboardInterrupt)."""
    started = folder / "started"
    proc = subprocess.Popen(command, cwd=folder, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.time() + 120
    while not started.exists() and time.time() < deadline and proc.poll() is None:
        time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGINT)
    out = proc.communicate(timeout=120)[0]
    return subprocess.CompletedProcess(command, proc.returncode, out, "")


def _make_pytest_args(target: str) -> list[str]:
    """The pytest options the Makefile's TARGET passes (`make -n`), the interpreter left out."""
    dry = subprocess.run(["make", "-n", target], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    line = next(line for line in dry.splitlines() if " -m pytest " in line)
    command = line.split(" -m pytest ", 1)[1].split(" || ")[0]
    return shlex.split(command)


def test_a_whole_passing_run_asked_to_writes_the_record_with_the_wall_time_and_the_slowest_test(tmp_path):
    _write(tmp_path, PASSING)
    out = tmp_path / "results" / "test_suite.json"
    proc = _pytest(tmp_path, "-n", "2", "--dist", "loadfile", "--suite-record", str(out))
    assert proc.returncode == 0, proc.stdout
    record = json.loads(out.read_text())
    assert record["slowest"][0]["test"] == "test_slow.py::test_sleeps" and record["slowest"][0]["seconds"] >= 0.6
    assert record["outcomes"] == {"passed": 4} and record["workers"] == 2 and record["exit_status"] == 0
    assert record["wall_seconds"] >= 0.6 and record["file_seconds"]["test_slow.py"] >= 0.6
    assert "| `test_slow.py::test_sleeps` |" in out.with_suffix(".md").read_text()
    assert "suite record: written to" in proc.stdout


def test_a_failed_interrupted_or_partial_run_leaves_the_record_as_it_was(tmp_path):
    _write(tmp_path, {**PASSING, **FAILING})
    record = tmp_path / "test_suite.json"
    record.write_text(json.dumps(OLD_RECORD))
    failed = _pytest(tmp_path, "-n", "2", "--dist", "loadfile", "--suite-record", str(record))
    assert failed.returncode == 1 and "left as it was (exit status 1: not a passing run)" in failed.stdout
    partial = _pytest(tmp_path, "-k", "not fails", "--suite-record", str(record))
    assert partial.returncode == 0 and "a selection, not the whole suite: -k" in partial.stdout, partial.stdout
    named = _pytest(tmp_path, "test_quick.py", "--suite-record", str(record))
    assert named.returncode == 0 and "files or tests named: test_quick.py" in named.stdout, named.stdout
    (tmp_path / "test_fails.py").unlink()
    _write(tmp_path, HANGING)
    stopped = _ctrl_c(tmp_path, [sys.executable, "-m", "pytest", "-q", "-p", "suite_timing", "-p", "no:cacheprovider",
                                 "-n", "2", "--dist", "loadfile", "--suite-record", str(record)])
    assert stopped.returncode == 2 and "left as it was (interrupted)" in stopped.stdout, stopped.stdout
    assert json.loads(record.read_text()) == OLD_RECORD and not record.with_suffix(".md").exists()


def test_files_run_longest_first_by_the_record_which_is_only_read(tmp_path):
    _write(tmp_path, PASSING)
    record = tmp_path / "test_suite.json"
    record.write_text(json.dumps(OLD_RECORD))
    proc = _pytest(tmp_path, "--collect-only", "--suite-order", str(record))
    order = [line for line in proc.stdout.splitlines() if "::" in line]
    assert order == ["test_slow.py::test_sleeps", "test_slow.py::test_also", "test_quick.py::test_a",
                     "test_quick.py::test_b"], proc.stdout
    ran = _pytest(tmp_path, "--suite-order", str(record))
    assert ran.returncode == 0 and json.loads(record.read_text()) == OLD_RECORD
    without = _pytest(tmp_path, "--collect-only")
    assert [line for line in without.stdout.splitlines() if "::" in line][0] == "test_quick.py::test_a"


def test_make_test_leaves_git_status_empty_after_a_pass_a_failure_and_a_ctrl_c(tmp_path):
    """`make test`'s own pytest options on a git repository holding a committed record and the project's
    .gitignore: after each kind of ending `git status --porcelain` is empty; `make test-record` asks to write."""
    args = _make_pytest_args("test")
    assert "--suite-order=benchmarks/results/test_suite.json" in args and not any("record" in a for a in args)
    assert "--suite-record=benchmarks/results/test_suite.json" in _make_pytest_args("test-record")
    repo = tmp_path / "repo"
    (repo / "benchmarks" / "results").mkdir(parents=True)
    (repo / "benchmarks" / "results" / "test_suite.json").write_text(json.dumps(OLD_RECORD))
    shutil.copy(ROOT / ".gitignore", repo / ".gitignore")
    _write(repo, PASSING)
    for cmd in (["init", "-q"], ["add", "-A"], ["-c", "user.email=t@t", "-c", "user.name=t", "commit", "-qm", "c"]):
        subprocess.run(["git", *cmd], cwd=repo, check=True)

    def status() -> str:
        return subprocess.run(["git", "status", "--porcelain"], cwd=repo, capture_output=True, text=True).stdout

    suite = [sys.executable, "-m", "pytest", "-p", "suite_timing", *args]
    passed = subprocess.run(suite, cwd=repo, env=_env(), capture_output=True, text=True, timeout=300)
    assert passed.returncode == 0 and status() == "", passed.stdout + status()

    _write(repo, FAILING)
    subprocess.run(["git", "add", "-A"], cwd=repo, check=True)
    subprocess.run(["git", "-c", "user.email=t@t", "-c", "user.name=t", "commit", "-qm", "a failing test"], cwd=repo,
                   check=True)
    failed = subprocess.run(suite, cwd=repo, env=_env(), capture_output=True, text=True, timeout=300)
    assert failed.returncode == 1 and status() == "", failed.stdout + status()

    (repo / "test_fails.py").unlink()
    _write(repo, HANGING)
    subprocess.run(["git", "add", "-A"], cwd=repo, check=True)
    subprocess.run(["git", "-c", "user.email=t@t", "-c", "user.name=t", "commit", "-qm", "a hanging test"], cwd=repo,
                   check=True)
    (repo / ".gitignore").write_text((repo / ".gitignore").read_text() + "/started\n")  # the test's own marker
    subprocess.run(["git", "-c", "user.email=t@t", "-c", "user.name=t", "commit", "-qam", "marker"], cwd=repo,
                   check=True)
    stopped = _ctrl_c(repo, suite)
    out = stopped.stdout
    assert stopped.returncode == 2 and "left as it was" not in out, out  # not asked to record: nothing said
    assert status() == "", out + status()
