"""benchmarks/update_ab.py reports each row's update-seconds ratio with its range, and says when the two checkouts'
rollouts were not the same work."""

from __future__ import annotations

from benchmarks.update_ab import markdown


def test_a_row_shows_its_ratio_range_and_whether_both_sides_timed_the_same_rollouts():
    row = {"row": "smollm2-long", "update_seconds_ratio_now_over_before": 0.9, "per_round_ratios": [0.85, 0.95],
           "update_seconds": {"now": 4.5, "before": 5.0}, "same_rollouts": True,
           "completion_tokens_per_set": [812, 790], "peak_rss_mb": {"now": 3900, "before": 3950}}
    report = {"commit": "new", "against_commit": "base", "machine": "m", "command": "c", "rows": [row]}
    assert ("| smollm2-long | **0.900** | 0.850 .. 0.950 | 4.500, 5.000 | yes | 812, 790 | 3900, 3950 | new, `c` |"
            in markdown(report))
    assert "| NO |" in markdown({**report, "rows": [{**row, "same_rollouts": False}]})
