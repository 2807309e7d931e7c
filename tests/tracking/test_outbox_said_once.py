"""An outage of the tracking server is said once per pipeline run, however many stages (processes) meet it, and
again for the next outage once it has ended (components/tracking/outbox.py)."""

from __future__ import annotations

from components.tracking.outbox import Outbox


def test_an_outage_is_said_once_per_run_and_again_after_it_ended(tmp_path):
    outbox = Outbox(tmp_path / ".tracking-outbox")
    assert outbox.announce_outage("run-1") is True  # grpo meets it first and says it
    assert outbox.announce_outage("run-1") is False  # evaluate, register, the parent run's job: said already
    assert Outbox(tmp_path / ".tracking-outbox").announce_outage("run-1") is False  # another process, same run
    assert outbox.announce_outage("run-2") is True  # the next pipeline run says it again
    outbox.outage_ended()  # the queue was sent: the server answers again
    assert outbox.announce_outage("run-2") is True  # a new outage in the same run is said
    assert outbox.announce_outage(None) is True and outbox.announce_outage(None) is True  # no run: each process
