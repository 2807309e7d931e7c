"""What a killed run leaves in DVC's files, recovered by the next run in one line (pipelines/leftovers.py), in a real
git + DVC repository: DVC itself refuses the damaged files (shown first), `dvc repro` works after the recovery, and
a file a live process holds is never touched."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from pipelines.leftovers import RWLOCK, recover_leftovers

from conftest import BIN, ROOT, run

HALF_A_DOCUMENT = '{"write": {"out.txt": {"pid": 4242, "cmd": "dvc repro"}}, "read": {"dv'


@pytest.fixture
def dvc_repo(tmp_path):
    """A git + DVC repository with one stage whose command copies its input to its output."""
    repo = tmp_path / "repo"
    repo.mkdir()
    run(["git", "init", "-q"], repo)
    run([str(BIN / "dvc"), "init", "-q"], repo)
    (repo / "in.txt").write_text("hello\n")
    (repo / "dvc.yaml").write_text("stages:\n  hello:\n    cmd: cat in.txt > out.txt\n    deps:\n      - in.txt\n"
                                   "    outs:\n      - out.txt\n")
    return repo


def dead_pid() -> int:
    return int(subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                              text=True).stdout)


def repro(repo) -> subprocess.CompletedProcess:
    return run([str(BIN / "dvc"), "repro"], repo, check=False)


@pytest.mark.parametrize("left", ["", HALF_A_DOCUMENT], ids=["empty", "truncated"])
def test_a_damaged_rwlock_is_recovered_in_one_line_and_dvc_runs_again(dvc_repo, left):
    """A kill while DVC rewrote `.dvc/tmp/rwlock` in place leaves it empty or half a JSON document; DVC then refuses
    every run. The next pipeline run removes it (no live process named in it) in one line, and `dvc repro` works."""
    rwlock = dvc_repo / RWLOCK
    rwlock.parent.mkdir(parents=True, exist_ok=True)
    rwlock.write_text(left)
    refused = repro(dvc_repo)
    assert refused.returncode != 0 and "Unable to read RWLock-file" in refused.stdout, refused.stdout
    said = recover_leftovers(dvc_repo)
    what = "empty" if not left else "cut short"
    assert said == [f"dvc: removed .dvc/tmp/rwlock ({what}, left by a run killed while DVC wrote it; no live process "
                    "holds it); DVC writes it afresh"]
    again = repro(dvc_repo)
    assert again.returncode == 0 and (dvc_repo / "out.txt").read_text() == "hello\n", again.stdout
    assert recover_leftovers(dvc_repo) == []  # DVC's own file, whole again: nothing to do


def test_entries_of_a_killed_run_go_with_one_line_and_dvc_prints_no_warning_of_its_own(dvc_repo):
    """A whole rwlock naming a process that is gone (the killed run) and one that lives: the dead one's entries are
    removed in one line without machine paths; the live one's stay. DVC then prints none of its `had been killed.
    Auto removed it` warnings."""
    gone = dead_pid()
    rwlock = dvc_repo / RWLOCK
    rwlock.parent.mkdir(parents=True, exist_ok=True)
    cmd = f"{sys.executable} -m pipelines.cli run"
    living = {"pid": os.getppid(), "cmd": "another dvc"}  # started before the file was written: its writer
    rwlock.write_text(json.dumps({"write": {"out.txt": {"pid": gone, "cmd": cmd}},
                                  "read": {"dvc.yaml": [{"pid": gone, "cmd": cmd}, living]}}))
    said = recover_leftovers(dvc_repo)
    assert said == [f"dvc: removed 2 entries of a killed run (pid {gone}) from .dvc/tmp/rwlock"]
    assert json.loads(rwlock.read_text()) == {"read": {"dvc.yaml": [living]}}
    living_writer = {"write": {"out.txt": living}}
    rwlock.write_text(json.dumps(living_writer))
    assert recover_leftovers(dvc_repo) == [] and json.loads(rwlock.read_text()) == living_writer
    rwlock.write_text(json.dumps({"write": {"out.txt": {"pid": gone, "cmd": cmd}}}))
    recover_leftovers(dvc_repo)
    out = repro(dvc_repo)
    assert out.returncode == 0 and "had been killed" not in out.stdout, out.stdout


def test_a_damaged_rwlock_that_names_a_live_process_is_left_alone(dvc_repo):
    rwlock = dvc_repo / RWLOCK
    rwlock.parent.mkdir(parents=True, exist_ok=True)
    text = '{"write": {"out.txt": {"pid": ' + str(os.getppid()) + ', "cmd": "dvc repro"}}, "re'
    rwlock.write_text(text)
    assert recover_leftovers(dvc_repo) == [f"dvc: left .dvc/tmp/rwlock alone (cut short): it names a live process "
                                           f"(pid {os.getppid()})"]
    assert rwlock.read_text() == text


def test_the_rwlock_is_not_touched_while_dvcs_own_guard_is_held(dvc_repo):
    """DVC edits the rwlock only while it holds `.dvc/tmp/rwlock.lock` (a kernel lock): held by a live process, the
    file is left as it is, whatever it holds."""
    rwlock = dvc_repo / RWLOCK
    rwlock.parent.mkdir(parents=True, exist_ok=True)
    rwlock.write_text("")
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time, zc.lockfile; "
                               "held = zc.lockfile.LockFile(sys.argv[1]); print('held', flush=True); time.sleep(60)",
                               str(dvc_repo / ".dvc/tmp/rwlock.lock")],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        assert recover_leftovers(dvc_repo) == ["dvc: left .dvc/tmp/rwlock alone: a live DVC process is editing it"]
        assert rwlock.exists() and rwlock.read_text() == ""
    finally:
        holder.kill()
        holder.wait()


@pytest.mark.parametrize("left", ["", "12345\n", "\x00garbage"], ids=["empty", "a dead pid", "garbage"])
def test_dvcs_repository_lock_left_by_a_killed_run_stops_nothing(dvc_repo, left):
    """`.dvc/tmp/lock` is a kernel lock (it dies with its process): whatever a killed run left in the file, DVC runs,
    and the recovery has nothing to say about it."""
    lock = dvc_repo / ".dvc" / "tmp" / "lock"
    lock.parent.mkdir(parents=True, exist_ok=True)
    lock.write_text(left)
    assert recover_leftovers(dvc_repo) == []
    assert repro(dvc_repo).returncode == 0


@pytest.mark.parametrize("cut", ["not YAML", "YAML, not DVC's schema"])
def test_a_dvc_lock_file_cut_short_is_set_aside_and_dvc_rebuilds_it(dvc_repo, cut):
    """DVC writes dvc.lock in place: a kill mid-write leaves text DVC cannot read, either not YAML or YAML its schema
    refuses (a stage cut before its first key: benchmarks/kill_anywhere.py met one such). It is moved to logs/ in one
    line; DVC rebuilds it (the stage's result comes back from DVC's run cache, not by running it again)."""
    assert repro(dvc_repo).returncode == 0
    (dvc_repo / "out.txt").unlink()  # the stage's result has to come back
    whole = (dvc_repo / "dvc.lock").read_text()
    left = (whole[: whole.index("outs:")] + "outs:\n  - path: [" if cut == "not YAML"
            else whole[: whole.index("cmd:")])
    (dvc_repo / "dvc.lock").write_text(left)
    refused = repro(dvc_repo)
    assert refused.returncode != 0 and "dvc.lock" in refused.stdout, refused.stdout
    said = recover_leftovers(dvc_repo)
    assert len(said) == 1 and said[0].startswith("dvc: dvc.lock was cut short by a kill while DVC wrote it (moved to "
                                                 "logs/dvc.lock-cut-short-")
    again = repro(dvc_repo)
    assert again.returncode == 0 and "is cached - skipping run" in again.stdout, again.stdout
    assert (dvc_repo / "out.txt").read_text() == "hello\n"


def test_the_pipeline_lock_left_with_any_content_is_taken_by_the_next_run(tmp_path):
    """`.grpo-pipeline.lock` is a kernel lock too: a killed run's file, empty or with anything in it, never stops the
    next run; held by a live process, the next run is refused naming it."""
    from components.locks import LockBusy, file_lock

    path = tmp_path / ".grpo-pipeline.lock"
    for left in ("", "pid 123, since", "\x00\x01"):
        path.write_text(left)
        with file_lock(path, "a pipeline run in this repository"):
            assert path.read_text().startswith(f"pid {os.getpid()}, since ")
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time; from components.locks import file_lock\n"
                               "with file_lock(__import__('pathlib').Path(sys.argv[1]), 'x'):\n"
                               "    print('held', flush=True); time.sleep(60)", str(path)],
                              stdout=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(LockBusy, match=f"is already running \\(pid {holder.pid}, since "):
            with file_lock(path, "a pipeline run in this repository"):
                pass
    finally:
        holder.kill()
        holder.wait()
