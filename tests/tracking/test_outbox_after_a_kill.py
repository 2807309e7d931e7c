"""The tracking queue a killed stage left (components/tracking/outbox.py): a record cut short while it was appended
is skipped in one line, never glued to the next one or sent half; the records before and after it reach a real
MLflow store once, and the sent count and the id map are written in one rename each."""

from __future__ import annotations

import json

from components.tracking.outbox import Outbox, local_id


def test_a_record_a_kill_cut_short_is_skipped_in_one_line_and_the_rest_is_sent_once(tmp_path, mlflow_store, capsys):
    from mlflow.tracking import MlflowClient

    client = MlflowClient(mlflow_store)
    outbox = Outbox(tmp_path / ".tracking-outbox")
    run = local_id()
    outbox.add({"op": "create_run", "id": run, "experiment": "after-a-kill", "tags": {"mlflow.runName": "grpo"},
                "time": 1_000})
    outbox.add({"op": "log_batch", "run": run, "metrics": [["loss", 0.5, 1_000, 1]]})
    with outbox.queue.open("a") as fh:  # the stage was killed while it appended this one
        fh.write('{"op": "log_batch", "run": "' + run + '", "metrics": [["loss", 0.4')
    outbox.add({"op": "log_batch", "run": run, "metrics": [["loss", 0.3, 3_000, 3]]})  # the rerun's stage
    assert outbox.pending() == 4
    assert outbox.send(client) == 3
    assert capsys.readouterr().out.strip() == ("tracking: skipped 1 queued record a kill cut short while it was "
                                               "written (never complete, so never sent)")
    server_id = outbox.resolve(run)
    history = client.get_metric_history(server_id, "loss")
    assert [(m.step, m.value) for m in history] == [(1, 0.5), (3, 0.3)]
    assert not outbox.queue.exists() and outbox.pending() == 0
    assert json.loads(outbox.ids_file.read_text()) == {run: server_id}
    assert not list(outbox.root.glob("*.tmp"))  # each bookkeeping file written in one rename


def test_bookkeeping_cut_short_by_an_older_version_is_read_as_nothing_sent(tmp_path):
    outbox = Outbox(tmp_path / ".tracking-outbox")
    outbox.add({"op": "terminate", "run": "r", "status": "KILLED", "time": 1})
    outbox.sent_file.write_text("")
    outbox.ids_file.write_text('{"offline-1": "ab')
    assert outbox.pending() == 1 and outbox.ids() == {} and outbox.resolve("offline-1") == "offline-1"
