"""No figure a user reads as a fact (README.md, docs/, the comments of params.yaml, configs/ and the Makefile, the
code's docstrings) that a generated table or a results file does not hold (benchmarks/doc_figures.py); no page cites
the changelog or names a path of the machine that measured; the changelog and the README stay short; no user page
names an issue or the machinery that ran a benchmark remotely.

The rule for counts: in the user pages, a whole number in digits (or in words from eleven up) followed by a plural
noun, at most two describing words between (`889 tests`, `12 rounds`, `twelve alternating rounds`), is a figure, and
a results file its paragraph names must hold it. Not counts: a label's number (`rank 0`), a period (`every 200
steps`), an operator's result or factor (`= 12 apples`, `× 8 completions`), a quoted example, and a count of a noun
in COUNTED_SETTINGS, each listed with why its counts are chosen (settings such as `16 prompts`, `128 tokens`), not
measured. Percentages (`40%`, `40 percent`, `forty percent`), numbers in words with a unit (`seventeen minutes`) and
multiples in digits (`28x`, `28 times TRL`) are figures too.
A figure no results file holds fails with its page, its line and the figure."""

from __future__ import annotations

import json
import re

import pytest

from benchmarks.doc_figures import (
    COUNTED_SETTINGS,
    NOT_MEASUREMENTS,
    PAGES,
    comments,
    figures,
    unheld,
    unheld_in,
    unheld_lines,
)

from conftest import ROOT

# The README's Quick start before its figures were generated: an install and a run measured once, by hand.
OLD_QUICK_START = """The first `make run` installs (149 s on a 2-core Intel Xeon, network permitting), then runs
for about five minutes (293 s there); peak memory: the default 0.7 GiB.
"""


def test_every_figure_a_user_reads_is_held_by_a_results_file():
    found = unheld()
    assert found == {}, "figures no results file of their paragraph holds (benchmarks/doc_figures.py):\n" + "\n".join(
        f"{page}, {entry}" for page, entries in found.items() for entry in entries)


def test_a_hand_copied_figure_is_caught_and_a_cited_one_passes():
    assert unheld_in(OLD_QUICK_START) == ["149 s", "293 s", "0.7 GiB", "five minutes"]
    band = json.loads((ROOT / "benchmarks" / "results" / "seed_spread.json").read_text())["rows"][0]
    low, high = band["ci95_low"], band["ci95_high"]
    cited = (f"The default improves by +{band['improvement']:.3f} (+{low:.3f} .. +{high:.3f}) "
             "([seed_spread.md](benchmarks/results/seed_spread.md)).")
    assert unheld_in(cited) == []
    # the same figures, one changed: stale
    assert unheld_in(cited.replace(f"+{band['improvement']:.3f}", "+0.999")) == ["+0.999"]
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


@pytest.fixture
def results(tmp_path):
    """A results folder holding one file, `benchmarks/results/suite.json`: 889 passed, 1020 s (17 minutes), 12
    rounds, a share of 0.4 and a ratio of 28.19."""
    (tmp_path / "suite.json").write_text(json.dumps({"passed": 889, "wall_seconds": 1020, "rounds": 12,
                                                     "share": 0.4, "speedup": 28.19}))
    return tmp_path


CITES = " ([suite.md](benchmarks/results/suite.json))"


def test_a_multiple_in_digits_is_read_without_crashing_and_checked(results):
    for held, stale in (("28 times TRL", "31 times TRL"), ("28x TRL", "31x TRL"), ("28.19x", "28.91x")):
        assert unheld_in(held + CITES, results=results) == []
        assert unheld_in(stale + CITES, results=results) == [stale.split(" TRL")[0].replace("x", " x")]


def test_a_count_with_a_noun_must_be_held(results):
    assert list(figures("The suite has 889 tests.")) == ["889 tests"]
    assert unheld_in("The suite has 889 tests and 12 alternating rounds." + CITES, results=results) == []
    assert unheld_in("The suite has 890 tests and 13 alternating rounds." + CITES, results=results) == [
        "890 tests", "13 alternating rounds"]
    assert unheld_in("twelve rounds" + CITES, results=results) == []
    assert unheld_in("thirteen rounds" + CITES, results=results) == ["thirteen rounds"]
    # uncited, a count fails whatever its number
    assert unheld_in("The suite has 889 tests.") == ["889 tests"]


def test_what_is_not_a_count():
    text = """rank 0 logs, level 1 adds torch; every 200 steps; "Ana has 7 apples"; 16 prompts x 8 completions of 128
tokens; three stages and two machines; 2 gloo processes vs 1, same losses; 7 + 5 = 12 apples"""
    assert unheld_in(text) == []
    assert {"prompts", "tokens", "processes"} <= set(COUNTED_SETTINGS)
    assert unheld_in("Ana has 7 apples.") == ["7 apples"]  # outside quotes, a count


def test_numbers_in_words_are_read(results):
    assert list(figures("it takes seventeen minutes, forty-two seconds")) == ["seventeen minutes", "forty-two seconds"]
    assert unheld_in("The suite takes seventeen minutes." + CITES, results=results) == []
    assert unheld_in("The suite takes nineteen minutes." + CITES, results=results) == ["nineteen minutes"]


def test_percentages_are_read_in_every_spelling(results):
    for written in ("40 percent", "40 per cent", "40%", "forty percent"):
        assert unheld_in(f"A share of {written}." + CITES, results=results) == [], written
    for written, figure in (("46 percent", "46 %"), ("46%", "46 %"), ("forty-six percent", "forty-six percent")):
        assert unheld_in(f"A share of {written}." + CITES, results=results) == [figure], written
    assert unheld_in("a 95 percent CI") == []  # the confidence level (NOT_MEASUREMENTS)


def test_an_unheld_figure_is_reported_with_its_page_and_line(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("# Title\n\nFirst line,\nthen 889 tests\n\n```bash\nmake\n```\n\nin seventeen minutes.\n")
    assert unheld_lines(page.read_text()) == [(4, "889 tests"), (10, "seventeen minutes")]
    assert unheld([page]) == {str(page): ["line 4: 889 tests", "line 10: seventeen minutes"]}
    module = tmp_path / "module.py"
    module.write_text('import os\n\n\ndef f():\n    """Fast.\n\n    It took 4.2 s."""\n')
    assert unheld([module]) == {str(module): ["line 7: 4.2 s"]}
    makefile = tmp_path / "Makefile"
    makefile.write_text("all:\n\ttrue\n# one line\n# then 3.5 GB\nX := 1  # 2.5 s\n")
    assert unheld([makefile]) == {str(makefile): ["line 4: 3.5 GB", "line 5: 2.5 s"]}


JARGON = re.compile(r"\bissue \d+|#\d{2,}\b|budget_left_s|`carry`|\bcarry: \[|timeout_s: \d|`status` says", re.I)


def test_no_user_page_names_an_issue_or_the_remote_runs_jargon():
    for page in PAGES:
        found = JARGON.findall(page.read_text())
        assert not found, f"{page.relative_to(ROOT)} names {found}: state the fact, not the issue or the tool"


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
