"""`make test`'s results file: the suite's wall time and its slowest tests, and files handed out longest first.
A real pytest run (two workers, as `make test`) on two small test files."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from conftest import ROOT

FILES = {
    "test_quick.py": "def test_a():\n    pass\n\ndef test_b():\n    pass\n",
    "test_slow.py": "import time\n\ndef test_sleeps():\n    time.sleep(0.6)\n\ndef test_fails():\n    assert False\n",
}


def _pytest(folder, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "tests")}
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "suite_timing", "-p", "no:cacheprovider",
                           "--rootdir", str(folder), *args], cwd=folder, env=env, capture_output=True, text=True,
                          timeout=300)


def test_the_record_names_the_wall_time_and_the_slowest_test(tmp_path):
    for name, text in FILES.items():
        (tmp_path / name).write_text(text)
    out = tmp_path / "results" / "test_suite.json"
    proc = _pytest(tmp_path, "-n", "2", "--dist", "loadfile", "--suite-results", str(out))
    assert proc.returncode == 1, proc.stdout  # the failing test still fails the run
    record = json.loads(out.read_text())
    assert record["slowest"][0]["test"] == "test_slow.py::test_sleeps" and record["slowest"][0]["seconds"] >= 0.6
    assert record["outcomes"] == {"passed": 3, "failed": 1} and record["workers"] == 2
    assert record["wall_seconds"] >= 0.6 and record["file_seconds"]["test_slow.py"] >= 0.6
    assert "| `test_slow.py::test_sleeps` |" in out.with_suffix(".md").read_text()


def test_files_run_longest_first_by_the_last_record(tmp_path):
    for name, text in FILES.items():
        (tmp_path / name).write_text(text)
    record = tmp_path / "test_suite.json"
    record.write_text(json.dumps({"file_seconds": {"test_quick.py": 1.0, "test_slow.py": 9.0}}))
    proc = _pytest(tmp_path, "--collect-only", "--suite-results", str(record))
    order = [line for line in proc.stdout.splitlines() if "::" in line]
    assert order == ["test_slow.py::test_sleeps", "test_slow.py::test_fails", "test_quick.py::test_a",
                     "test_quick.py::test_b"], proc.stdout
    without = _pytest(tmp_path, "--collect-only")
    assert [line for line in without.stdout.splitlines() if "::" in line][0] == "test_quick.py::test_a"
