"""The note a running stage keeps for the rerun after a silent death (components/run_marker.py)."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys

from components.run_marker import NoMarker, RunMarker, killed_run_text


def _dead_pid() -> int:
    return int(subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                              text=True).stdout)


def test_a_note_left_by_a_dead_process_is_read_back_and_a_live_one_is_not(tmp_path):
    path = tmp_path / "grpo.running.json"
    dead = _dead_pid()
    path.write_text(json.dumps({"pid": dead, "started": "2026-11-26 10:00:00", "step": 40, "steps": 100,
                                "estimate_gb": 3.0, "available_gb": 20.0, "knobs": "grpo.minibatch_size=32"}))
    note = RunMarker(path).left_by_a_killed_run()
    assert note is not None and killed_run_text("grpo", note) == (
        f"grpo: the previous run of this stage (pid {dead}, started 2026-11-26 10:00:00) ended without a word at step "
        "40 of 100: it was killed (SIGKILL), by another process or the machine (a preempted machine, `kill -9`); its "
        "step was estimated at 3.0 GB with 20.0 GB free")
    path.write_text(json.dumps({"pid": os.getppid()}))  # a process that is alive: another run, not a dead one
    assert RunMarker(path).left_by_a_killed_run() is None
    marker = RunMarker(path)
    marker.write(step=3)
    assert json.loads(path.read_text())["pid"] == os.getpid() and marker.left_by_a_killed_run() is None
    marker.clear()
    assert not path.exists()


def test_the_out_of_memory_killer_is_named_only_when_the_memory_estimate_makes_it_likely():
    """1.0 GB of 20 GB free: a SIGKILL came from another process or the machine; 18 GB of 20 GB: likely the kernel's
    out-of-memory killer, with the knobs that lower a step's memory."""
    from components.run_marker import ended_text

    roomy = {"pid": 1, "started": "s", "step": 3, "steps": 6, "estimate_gb": 1.0, "available_gb": 20.0,
             "knobs": "grpo.minibatch_size=32"}
    tight = {**roomy, "estimate_gb": 18.0}
    assert ended_text(roomy, -9) == ("the stage was killed by SIGKILL (another process or the machine) at step 3 of "
                                     "6; its step was estimated at 1.0 GB with 20.0 GB free; rerun to resume")
    assert ended_text(tight, -9) == ("the stage was killed by SIGKILL at step 3 of 6, likely by the kernel's "
                                     "out-of-memory killer; its step was estimated at 18.0 GB with 20.0 GB free "
                                     "(lower it with grpo.minibatch_size=32); rerun to resume")
    assert "out-of-memory" not in killed_run_text("grpo", roomy) and "out-of-memory" not in ended_text({}, -9)
    assert "likely by the kernel's out-of-memory killer" in killed_run_text("grpo", tight)


def test_a_note_cut_short_or_empty_is_a_dead_runs_and_is_said_once(tmp_path, monkeypatch):
    """A kill while the note was first written leaves it empty or cut short, naming no pid: the rerun takes it for
    a dead run's (said in one line), writes its own over it, and removes it at its end."""
    monkeypatch.chdir(tmp_path)
    for left in ("", '{"pid": 12'):
        path = tmp_path / "grpo.running.json"
        path.write_text(left)
        note = RunMarker(path).left_by_a_killed_run()
        assert note == {"cut_short": True}
        assert killed_run_text("grpo", note) == ("grpo: the previous run of this stage was killed (SIGKILL) while it "
                                                 "wrote its note, which it left cut short (replaced now)")
        marker = RunMarker(path)
        marker.write(step=1)
        assert json.loads(path.read_text())["pid"] == os.getpid()
        marker.clear()


def test_a_pid_reused_since_the_note_was_written_is_not_its_writer(tmp_path):
    """After a reboot (a preempted machine) pids start again: a live process with the note's pid that started after
    the note was last written did not write it, so the note is a dead run's."""
    path = tmp_path / "grpo.running.json"
    path.write_text(json.dumps({"pid": os.getppid(), "started": "s"}))
    os.utime(path, (1.0, 1.0))  # written long before the live process with that pid started
    assert RunMarker(path).left_by_a_killed_run() is not None


def test_ranks_that_keep_no_note_touch_no_file(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    marker = NoMarker()
    marker.write(step=1)
    marker.clear()
    assert marker.left_by_a_killed_run() is None and list(tmp_path.iterdir()) == []
    assert stat.S_ISCHR(os.stat(os.devnull).st_mode)  # (a first version wrote its note over /dev/null)


def test_a_note_left_while_the_users_code_ran_blames_that_code_not_the_memory(tmp_path):
    """When the launcher died with the stage (the whole run killed), the rerun reads the note: a death inside the
    user's reward is said as such, never as the out-of-memory killer's."""
    from components.run_marker import ended_text

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    note = {"pid": int(dead.stdout), "started": "2026-11-26 10:00:00", "steps": 6, "user_code": "reward 'm:f'",
            "user_code_doing": "scoring", "progress": "at step 2 of 6; no checkpoint yet"}
    path = tmp_path / "grpo.running.json"
    path.write_text(json.dumps(note))
    text = killed_run_text("grpo", RunMarker(path).left_by_a_killed_run())
    assert text == (f"grpo: the previous run of this stage (pid {int(dead.stdout)}, started 2026-11-26 10:00:00) "
                    "ended while reward 'm:f' was scoring at step 2 of 6; no checkpoint yet: the user's code ended "
                    "the process (os._exit, a crash or an abort in a C extension), not the pipeline")
    assert "out-of-memory" not in text
    assert ended_text({**note, "user_code": None}, -9).startswith("the stage was killed by SIGKILL (another process or "
                                                                  "the machine) at step 2 of 6")
