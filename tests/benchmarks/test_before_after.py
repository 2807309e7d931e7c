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
