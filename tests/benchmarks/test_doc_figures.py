"""No figure on a user page (README.md, docs/) that a generated table or a results file does not hold: each
hand-written figure must be held by a results file its paragraph names (benchmarks/doc_figures.py)."""

from __future__ import annotations

from benchmarks.doc_figures import NOT_MEASUREMENTS, figures, unheld, unheld_in

# The README's Quick start before its figures were generated: an install and a run measured once, by hand.
OLD_QUICK_START = """The first `make run` installs (149 s on a 2-core Intel Xeon, network permitting), then runs
for about five minutes (293 s there); peak memory: the default 0.7 GiB.
"""


def test_every_figure_on_the_user_pages_is_held_by_a_results_file():
    assert unheld() == {}, "figures no results file of their paragraph holds (benchmarks/doc_figures.py)"


def test_a_hand_copied_figure_is_caught_and_a_cited_one_passes():
    assert unheld_in(OLD_QUICK_START) == ["149 s", "293 s", "0.7 GiB"]
    cited = "The default improves by +0.338 (+0.287 .. +0.413) ([seed_spread.md](benchmarks/results/seed_spread.md))."
    assert unheld_in(cited) == []
    # the same figures, one changed: stale
    assert unheld_in(cited.replace("+0.338", "+0.357")) == ["+0.357"]
    # a figure another results file holds does not count for a paragraph that names a different one
    assert unheld_in("A warm start at 0.518 ([seed_spread.md](benchmarks/results/seed_spread.md)).") == ["0.518"]
    assert unheld_in("A warm start at 0.518 (`benchmarks/grpo_variants.py --task default`, "
                     "benchmarks/results/grpo_variants_default.md).") == []


def test_what_is_not_a_figure():
    text = """Python 3.11 and TRL 1.16 (versions), `--set grpo.kl_beta=0.1` (code), lr 5e-4, 16 prompts × 8, seed 1234,
every 200 steps, (default 6 h), a 95% CI, arXiv 2402.03300.

<!-- generated: learning -->
| 0.999 | 12.5 s |
<!-- end generated -->

```bash
python benchmarks/seed_spread.py --threads 2.5
```
"""
    assert list(figures(text)) == ["95 %"] and "95 %" in NOT_MEASUREMENTS
    assert unheld_in(text) == []


def test_tables_lists_and_shown_output_read_with_the_paragraph_before_them():
    page = """From [smollm2_seeds.md](benchmarks/results/smollm2_seeds.md):

- held-out after GRPO 0.813 (0.757 .. 0.823)

| after | 0.813 |

```
after GRPO: 0.813
```
"""
    assert unheld_in(page) == []
    assert unheld_in(page.split("\n\n", 1)[1]) == ["0.813", "0.757", "0.823", "0.813", "0.813"]
