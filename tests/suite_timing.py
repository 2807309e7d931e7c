"""The test suite's record (its wall time, outcomes and slowest tests) and the order test files are handed to the
workers (longest first, from that record).

    pytest --suite-order benchmarks/results/test_suite.json     # what `make test` passes: reads the record only
    pytest --suite-order ... --suite-record benchmarks/results/test_suite.json   # `make test-record`

`--suite-order` only reads: `make test` writes no file of the repository, passing, failing or interrupted.
`--suite-record` writes the record (JSON, and a Markdown table beside it) only at the end of a whole passing run:
every collected test run (nothing deselected by `-k`, `-m` or `--deselect`, no file or test named on the command
line, no `--lf`/`--sw`), exit status 0, not interrupted; any other run leaves the record as it was and says why in
one line. The JSON holds the wall time, the outcome counts, the machine, the commit, every file's seconds and the
10 slowest tests (setup + call + teardown). With pytest-xdist the controller writes it, from the reports the
workers send back.

Ordering: with `--no-loadscope-reorder`, `--dist loadfile` hands out files in collection order, so a long file
collected last leaves one worker running it alone at the end (without it xdist hands out files with most tests
first, whatever the collection order). Files go in order of their seconds in the record (files it does not know
first), or without a record, files with a slow test first.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import time
from collections import defaultdict
from pathlib import Path

import pytest

SLOWEST = 10


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--suite-order", metavar="PATH", default=None,
                     help="hand test files out longest first by the record at PATH (read only)")
    parser.addoption("--suite-record", metavar="PATH", default=None,
                     help="after a whole passing run, write the suite's wall time and slowest tests to PATH (.json) "
                          "and PATH's .md")


def _option_path(config: pytest.Config, name: str) -> Path | None:
    value = config.getoption(name)
    return Path(value) if value else None


def _recorded_file_seconds(config: pytest.Config) -> dict[str, float]:
    path = _option_path(config, "--suite-order")
    try:
        return json.loads(path.read_text())["file_seconds"] if path else {}
    except (OSError, ValueError, KeyError):
        return {}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Longest files first: by the last record's seconds (files it does not know first of all), or without a
    record, files with a test marked slow first. A file's tests stay together and in their order."""
    recorded = _recorded_file_seconds(config)
    first_seen: dict[str, int] = {}
    slow: set[str] = set()
    for item in items:
        file = item.nodeid.split("::")[0]
        first_seen.setdefault(file, len(first_seen))
        if item.get_closest_marker("slow") is not None:
            slow.add(file)

    def key(item: pytest.Item) -> tuple[float, int]:
        file = item.nodeid.split("::")[0]
        rank = -recorded.get(file, float("inf")) if recorded else (0 if file in slow else 1)
        return rank, first_seen[file]

    items.sort(key=key)


class SuiteTiming:
    """Collects each test's seconds (all phases); writes the record at the end of a whole passing session."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.started = time.time()
        self.seconds: dict[str, float] = defaultdict(float)
        self.outcomes: dict[str, int] = defaultdict(int)

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        self.seconds[report.nodeid] += report.duration
        if report.when == "call" or report.outcome != "passed":
            self.outcomes[report.outcome if report.when == "call" else
                          ("skipped" if report.outcome == "skipped" else "error")] += 1

    def pytest_sessionfinish(self, session: pytest.Session, exitstatus: int) -> None:
        config = session.config
        why_not = not_whole(config, int(exitstatus), dict(self.outcomes))
        if why_not:
            print(f"\nsuite record: {self.path} left as it was ({why_not})")
            return
        record = self.record(config, int(exitstatus))
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text(json.dumps(record, indent=1) + "\n")
        self.path.with_suffix(".md").write_text(markdown(record))
        print(f"\nsuite record: written to {self.path} (and .md)")

    def record(self, config: pytest.Config, exitstatus: int) -> dict:
        files: dict[str, float] = defaultdict(float)
        for nodeid, seconds in self.seconds.items():
            files[nodeid.split("::")[0]] += seconds
        slowest = sorted(self.seconds.items(), key=lambda kv: -kv[1])[:SLOWEST]
        return {
            "command": "make test-record (pytest " + " ".join(config.invocation_params.args) + ")",
            "wall_seconds": round(time.time() - self.started, 1), "exit_status": exitstatus,
            "outcomes": dict(self.outcomes), "workers": getattr(config.option, "numprocesses", None) or 1,
            "machine": _machine(), "commit": _commit(config.rootpath),
            "finished": time.strftime("%Y-%m-%d %H:%M", time.localtime()),
            "slowest": [{"test": nodeid, "seconds": round(s, 1)} for nodeid, s in slowest],
            "file_seconds": {f: round(s, 1) for f, s in sorted(files.items(), key=lambda kv: -kv[1])},
        }


def not_whole(config: pytest.Config, exitstatus: int, outcomes: dict[str, int]) -> str:
    """Why this session is not a whole passing run of the suite ("" when it is)."""
    option = config.option
    if exitstatus == pytest.ExitCode.INTERRUPTED:
        return "interrupted"
    if exitstatus != 0:
        return f"exit status {exitstatus}: not a passing run"
    if getattr(option, "collectonly", False) or not outcomes.get("passed"):
        return "no test ran"
    chosen = [flag for flag, on in (("-k", option.keyword), ("-m", option.markexpr),
                                    ("--deselect", getattr(option, "deselect", None)),
                                    ("--lf", getattr(option, "lf", False)),
                                    ("--sw", getattr(option, "stepwise", False))) if on]
    if config.args_source == pytest.Config.ArgsSource.ARGS:
        chosen.append("files or tests named: " + " ".join(config.args))
    return f"a selection, not the whole suite: {', '.join(chosen)}" if chosen else ""


def markdown(record: dict) -> str:
    m = record["machine"]
    counts = ", ".join(f"{n} {what}" for what, n in sorted(record["outcomes"].items()))
    lines = [f"# The test suite's time (written by `{record['command']}`)", "",
             f"{record['wall_seconds'] / 60:.1f} min wall ({record['wall_seconds']:.0f} s), {counts}, "
             f"{record['workers']} workers, on {m['cpu']} ({m['cores']} cores), commit {record['commit']}, "
             f"{record['finished']}. Exit status {record['exit_status']}.", "",
             f"The {len(record['slowest'])} slowest tests (setup + call + teardown):", "",
             "| seconds | test |", "|---:|---|"]
    lines += [f"| {row['seconds']:.1f} | `{row['test']}` |" for row in record["slowest"]]
    return "\n".join(lines) + "\n"


def _machine() -> dict:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"cpu": cpu, "cores": os.cpu_count(), "python": platform.python_version()}


def _commit(root: Path) -> str:
    proc = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True)
    return proc.stdout.strip() or "unknown"


def pytest_configure(config: pytest.Config) -> None:
    path = _option_path(config, "--suite-record")
    if path is not None and not hasattr(config, "workerinput"):  # the controller (or a run without xdist) writes
        config.pluginmanager.register(SuiteTiming(path), "suite-timing")
