"""benchmarks/before_after.py records its command without this machine's paths, and each row with its own commit."""

from __future__ import annotations

from benchmarks.before_after import markdown, shown_command


def test_the_recorded_command_names_no_path_of_this_machine():
    argv = ["--against", "/work/base", "--rows", "smollm2-lora", "--work", "/scratch/ba", "--out=/tmp/r", "--update"]
    assert shown_command(argv, "482362a") == ("python benchmarks/before_after.py --against CHECKOUT_OF_482362a "
                                              "--rows smollm2-lora --work SCRATCH --out=OUT --update")


def test_each_row_shows_the_commit_and_command_it_was_measured_with():
    row = {"row": "tiny", "ratio_now_over_before": 1.0, "per_round_ratios": [0.9, 1.1],
           "completions_per_s": {"now": 1.0, "before": 1.0}, "peak_rss_mb": {"now": 1, "before": 1},
           "heldout_reward": {"now": 0.5, "before": 0.5}}
    report = {"commit": "new", "against_commit": "base", "machine": "m", "command": "python b.py --rows lora",
              "rows": [{**row, "commit": "old", "command": "python b.py --rows tiny"}, {**row, "row": "lora"}]}
    page = markdown(report)
    assert "| old, `python b.py --rows tiny` |" in page and "| new, `python b.py --rows lora` |" in page


def test_rows_with_update_timings_show_the_updates_ratio_and_range_beside_tokens_per_second():
    row = {"row": "smollm2-long", "ratio_now_over_before": 1.1, "per_round_ratios": [1.0, 1.2],
           "completions_per_s": {"now": 2.0, "before": 1.8}, "peak_rss_mb": {"now": 1, "before": 1},
           "heldout_reward": {"now": 0.5, "before": 0.5}, "update_seconds_ratio_now_over_before": 0.8,
           "per_round_update_seconds_ratios": [0.75, 0.85], "update_seconds": {"now": 4.0, "before": 5.0},
           "tokens_per_s_ratio_now_over_before": 1.12, "per_round_tokens_per_s_ratios": [1.05, 1.2]}
    page = markdown({"commit": "new", "against_commit": "base", "machine": "m", "command": "c", "rows": [row]})
    assert "| smollm2-long | **0.800** | 0.750 .. 0.850 | 4.000, 5.000 | **1.120** | 1.050 .. 1.200 |" in page
