"""Checkpoints of other inputs are set aside, not removed, and come back with their inputs (a bounded number of
sets); a half-written one is named as such (components/data/checkpoints.py)."""

from __future__ import annotations

import json
import time

from components.data.checkpoints import KEEP_OTHER_INPUTS, latest_checkpoint, set_aside_other_inputs


def _checkpoint(root, name, run_hash):
    (root / name).mkdir(parents=True)
    (root / name / "meta.json").write_text(json.dumps({"step": 1, "run_hash": run_hash, "files": {}}))


def test_other_inputs_checkpoints_survive_a_run_and_come_back_with_their_inputs(tmp_path):
    root = tmp_path / "checkpoints" / "grpo"
    _checkpoint(root, "step-0000003", "a" * 64)
    _checkpoint(root, "best", "a" * 64)
    (root / ".tmp-step-0000006").mkdir()  # a kill while step 6 was being written
    said: list[str] = []
    set_aside_other_inputs(root, "b" * 64, said.append)  # a run of other inputs
    assert said[0] == (f"grpo: removed {root / '.tmp-step-0000006'}: a checkpoint whose writing was cut off "
                       "(half-written, never resumed)")
    aside = tmp_path / "checkpoints" / "grpo-other-inputs" / ("a" * 16)
    assert sorted(p.name for p in aside.iterdir()) == ["best", "step-0000003"] and list(root.iterdir()) == []
    assert any("set aside checkpoint" in line and "(trained from other inputs)" in line for line in said)
    assert not any("removed checkpoint" in line for line in said)

    _checkpoint(root, "step-0000002", "b" * 64)  # that run's own
    said.clear()
    set_aside_other_inputs(root, "a" * 64, said.append)  # back to the first inputs: their checkpoints return
    assert latest_checkpoint(root, "a" * 64).name == "step-0000003" and (root / "best").is_dir()
    assert (tmp_path / "checkpoints" / "grpo-other-inputs" / ("b" * 16) / "step-0000002").is_dir()
    assert not aside.exists() and sum("brought back" in line for line in said) == 2


def test_only_the_most_recent_sets_of_other_inputs_are_kept(tmp_path):
    root = tmp_path / "checkpoints" / "grpo"
    hashes = [c * 64 for c in "cdefg"]
    for previous, current in zip(hashes, hashes[1:]):
        _checkpoint(root, "step-0000001", previous)
        set_aside_other_inputs(root, current, lambda _: None)
        time.sleep(0.01)  # distinct modification times
    kept = sorted(p.name for p in (tmp_path / "checkpoints" / "grpo-other-inputs").iterdir())
    assert len(hashes) - 1 > KEEP_OTHER_INPUTS
    assert kept == sorted(h[:16] for h in hashes[-1 - KEEP_OTHER_INPUTS:-1])  # the oldest set went
