"""How the flow reads DVC's account of a stage's command: a signal named as such (pipelines/dvc_writes.py)."""

from __future__ import annotations

import signal

from pipelines.dvc_writes import killed_by


def test_a_stage_killed_by_a_signal_is_named_by_it_whoever_ran_its_command():
    from dvc.exceptions import ReproductionError
    from dvc.stage.exceptions import StageCmdFailedError

    def failed(status: int) -> Exception:  # as DVC raises it: the command's failure as the cause
        try:
            raise ReproductionError("grpo") from StageCmdFailedError("python -m components.runtime.launch grpo", status)
        except ReproductionError as err:
            return err

    assert killed_by(failed(-9)) == signal.SIGKILL  # the launcher ended by the stage's own signal
    assert killed_by(failed(137)) == signal.SIGKILL  # a shell that ran it without exec: 128 + the signal
    assert killed_by(failed(-6)) == signal.SIGABRT
    assert killed_by(failed(3)) is None and killed_by(failed(1)) is None  # an exit code is not a signal
