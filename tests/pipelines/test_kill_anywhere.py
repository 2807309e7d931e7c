"""A SIGKILL of the whole run at seeded random moments, and the same command again: each rerun ends as the
uninterrupted run did (benchmarks/kill_anywhere.py, which runs 40 moments; here a few, for the suite)."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.slow


@pytest.mark.timeout(1800)
def test_kills_at_seeded_random_moments_leave_reruns_that_end_as_an_uninterrupted_run(tmp_path, stage_server):
    from benchmarks.kill_anywhere import kill_anywhere, markdown

    # The reruns on the worker's stage server; the uninterrupted and the killed runs start their own.
    result = kill_anywhere(moments=2, seed=7, work=tmp_path, rerun_server=stage_server[1])
    table = markdown(result)
    print(table)
    for row in result["moments"]:  # a rerun that failed: its own last lines, beside the table
        if row["rerun"]["exit"]:
            table += f"\nmoment {row['moment'] + 1}'s rerun ended with exit {row['rerun']['exit']}:\n" + \
                "\n".join(row["rerun"]["last_lines"])
    assert result["summary"] == {"moments": 2, "exact": 2, "by_stage": result["summary"]["by_stage"]}, table
    for row in result["moments"]:
        assert row["exact"] and not row["failed"], table
        assert row["landed"]["stage"] and 0 <= row["delay_s"] <= result["uninterrupted_seconds"]
        assert not any("had been killed" in line for line in row["rerun"]["said"]), table
