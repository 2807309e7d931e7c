"""No figure a user reads as a fact (README.md, docs/, the comments of params.yaml, configs/ and the Makefile, the
code's docstrings) that a generated table or a results file does not hold (benchmarks/doc_figures.py); no page cites
the changelog or names a path of the machine that measured; the changelog and the README stay short."""

from __future__ import annotations

import re

from benchmarks.doc_figures import NOT_MEASUREMENTS, PAGES, comments, figures, unheld, unheld_in

from conftest import ROOT

# The README's Quick start before its figures were generated: an install and a run measured once, by hand.
OLD_QUICK_START = """The first `make run` installs (149 s on a 2-core Intel Xeon, network permitting), then runs
for about five minutes (293 s there); peak memory: the default 0.7 GiB.
"""


def test_every_figure_a_user_reads_is_held_by_a_results_file():
    assert unheld() == {}, "figures no results file of their paragraph holds (benchmarks/doc_figures.py)"


def test_a_hand_copied_figure_is_caught_and_a_cited_one_passes():
    assert unheld_in(OLD_QUICK_START) == ["149 s", "293 s", "0.7 GiB", "five minutes"]
    cited = "The default improves by +0.338 (+0.287 .. +0.413) ([seed_spread.md](benchmarks/results/seed_spread.md))."
    assert unheld_in(cited) == []
    # the same figures, one changed: stale
    assert unheld_in(cited.replace("+0.338", "+0.357")) == ["+0.357"]
    # a figure another results file holds does not count for a paragraph that names a different one
    assert unheld_in("A warm start at 0.518 ([seed_spread.md](benchmarks/results/seed_spread.md)).") == ["0.518"]
    assert unheld_in("A warm start at 0.518 (`benchmarks/grpo_variants.py --task default`, "
                     "benchmarks/results/grpo_variants_default.md).") == []


def test_whole_numbers_spelled_out_figures_and_multiples_are_read():
    """The stale sentences that were left unchecked before: each is caught now."""
    assert unheld_in("the warm start usually stops after 6-10 epochs") == ["6", "-10"]
    assert unheld_in("python tests/mutation_check.py   # about 5 minutes on 2 cores") == ["5 minutes"]
    assert unheld_in("Smoke test in about a minute: every stage runs for real.") == ["a minute"]
    assert unheld_in("distinct rows fall from 43–50 of 64 early") == ["43", "50", "50 of 64"]
    assert unheld_in("oneDNN reaches about twice the rate there; the step ran in half the time") == ["twice", "half"]
    assert unheld_in("some 2,600 operator calls a step") == ["2,600"]
    # counts of events, parts and arithmetic are not figures
    assert unheld_in("Written twice; half of its groups; 7 + 5 = 12 apples, 12 - 3 = 9; every 200 steps") == []


def test_what_is_not_a_figure():
    text = """Python 3.11 and TRL 1.16 (versions), `--set grpo.kl_beta=0.1` (code), lr 5e-4, 16 prompts × 8, seed 1234,
every 200 steps, (default 6 h), 900 s by default, a 95% CI, arXiv 2402.03300.

<!-- generated: learning -->
| 0.999 | 12.5 s |
<!-- end generated -->

```bash
python benchmarks/seed_spread.py --threads 2.5
```
"""
    assert list(figures(text)) == ["95 %"] and "95 %" in NOT_MEASUREMENTS
    assert unheld_in(text) == []


def test_a_yaml_comment_may_state_its_own_setting_and_nothing_measured():
    yaml_text = """window: 400            # last 400 steps vs the first 400
stop_at_reward: 0.5      # stop once greedy exact match reaches 0.5
onednn_matmul: true      # large products on oneDNN (2x MKL on AMD AVX-512)
"""
    found = [f for comment, settings in comments(yaml_text) for f in figures(comment, settings)]
    assert found == ["2 x"]


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


MACHINE_PATH = re.compile(r"(?<![\w.])/(?:opt|home|root|work|tmp|Users|var)/[\w./-]+|file:///\S+")


def test_no_page_cites_the_changelog_or_a_path_of_the_measuring_machine():
    results_pages = sorted((ROOT / "benchmarks" / "results").glob("*.md"))
    for page in [*PAGES, *results_pages]:
        text = page.read_text()
        assert not MACHINE_PATH.findall(text), f"{page.name} names a path of this machine"
        if page.name != "HISTORY.md":
            assert "HISTORY" not in text, f"{page.name} cites the changelog: cite the results file instead"


def test_the_changelog_is_dated_newest_first_short_and_its_links_resolve():
    history = ROOT / "benchmarks" / "results" / "HISTORY.md"
    text = history.read_text()
    assert len(text.splitlines()) <= 300
    dates = re.findall(r"^## (\d{4}-\d{2}-\d{2})", text, re.M)
    assert dates and dates == sorted(dates, reverse=True), dates
    for target in re.findall(r"\]\(([^)#\s]+)", text):
        assert (history.parent / target).exists(), f"HISTORY.md links to {target}, which does not exist"
    assert len((ROOT / "README.md").read_text().splitlines()) <= 300
