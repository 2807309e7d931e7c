"""The note a running stage keeps for the rerun after a silent death (components/run_marker.py)."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys

from components.run_marker import NoMarker, RunMarker, killed_run_text


def test_a_note_left_by_a_dead_process_is_read_back_and_a_live_one_is_not(tmp_path):
    path = tmp_path / "grpo.running.json"
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    path.write_text(json.dumps({"pid": int(dead.stdout), "started": "2026-11-26 10:00:00", "step": 40, "steps": 100,
                                "estimate_gb": 3.0, "available_gb": 20.0, "knobs": "grpo.minibatch_size=32"}))
    note = RunMarker(path).left_by_a_killed_run()
    assert note is not None and killed_run_text("grpo", note) == (
        f"grpo: the previous run of this stage (pid {int(dead.stdout)}, started 2026-11-26 10:00:00) ended without a "
        "word at step 40 of 100: it was killed (SIGKILL), most often by the kernel's out-of-memory killer; its step "
        "was estimated at 3.0 GB with 20.0 GB free (lower it with grpo.minibatch_size=32), or a preempted machine")
    path.write_text(json.dumps({"pid": os.getppid()}))  # a process that is alive: another run, not a dead one
    assert RunMarker(path).left_by_a_killed_run() is None
    marker = RunMarker(path)
    marker.write(step=3)
    assert json.loads(path.read_text())["pid"] == os.getpid() and marker.left_by_a_killed_run() is None
    marker.clear()
    assert not path.exists()


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
    assert ended_text({**note, "user_code": None}, -9).startswith("the stage was killed by SIGKILL at step 2 of 6")
