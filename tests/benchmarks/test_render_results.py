"""The results tables of README.md and docs/ are generated from benchmarks/results/*.json: a page that disagrees
fails here."""

from __future__ import annotations

import json
import re

from benchmarks.render_results import PAGES, TABLES, render

from conftest import ROOT

BLOCK = re.compile(r"<!-- generated: ([\w-]+) -->")


def test_every_generated_table_matches_its_results_file():
    for page in PAGES:
        text = page.read_text()
        names = BLOCK.findall(text)
        assert names, f"{page.name} has no generated table"
        assert not set(names) - set(TABLES), f"{page.name} names unknown tables: {set(names) - set(TABLES)}"
        assert len(names) == text.count("<!-- end generated -->"), f"{page.name}: a generated block is not closed"
        assert render(text) == text, f"{page.name} disagrees with benchmarks/results: run benchmarks/render_results.py"


def test_every_table_is_used_on_a_page():
    used = {name for page in PAGES for name in BLOCK.findall(page.read_text())}
    assert set(TABLES) <= used, f"tables on no page: {set(TABLES) - used}"


def _results_copy(tmp_path, monkeypatch):
    import benchmarks.render_results as rr

    results = tmp_path / "results"
    results.mkdir()
    for f in (ROOT / "benchmarks" / "results").glob("*.json"):
        (results / f.name).write_text(f.read_text())
    monkeypatch.setattr(rr, "RESULTS", results)
    return results


def test_a_changed_figure_changes_the_page(tmp_path, monkeypatch):
    results = _results_copy(tmp_path, monkeypatch)
    data = json.loads((results / "grpo_vs_trl.json").read_text())
    data["rows"][0]["speedup_vs_trl"] = 1.23
    (results / "grpo_vs_trl.json").write_text(json.dumps(data))
    for page in (ROOT / "README.md", ROOT / "docs" / "performance.md"):
        text = page.read_text()
        assert render(text) != text and "**1.23×**" in render(text), page.name


def test_a_changed_heldout_run_changes_the_evaluation_page(tmp_path, monkeypatch):
    results = _results_copy(tmp_path, monkeypatch)
    data = json.loads((results / "heldout_curves.json").read_text())
    data["rows"].append(dict(data["rows"][0], seed=99, train_gain=0.5, heldout_gain=0.01, heldout_flat=0.5,
                             breached=True))
    (results / "heldout_curves.json").write_text(json.dumps(data))
    text = (ROOT / "docs" / "evaluation.md").read_text()
    assert "| the default, seed 99 | +0.500 | +0.010 " in render(text) and "0.500, warned" in render(text)


def test_an_empty_block_is_filled_and_the_next_block_and_text_between_stay():
    page = ("<!-- generated: gpu-long-row -->\n<!-- end generated -->\n\nhand-written\n\n"
            "<!-- generated: trl-long-row -->\nold\n<!-- end generated -->\n")
    fresh = render(page)
    assert "hand-written" in fresh and fresh.count("<!-- end generated -->") == 2
    assert "completion tokens/s" in fresh.split("hand-written")[0] and "old" not in fresh


def test_a_tool_row_shows_in_the_readme_in_model_tokens_a_second(tmp_path, monkeypatch):
    """The calculator row (benchmarks/grpo_vs_trl.py --rows calculator) leads with the model's own tokens a second,
    episodes a second beside it."""
    results = _results_copy(tmp_path, monkeypatch)
    data = json.loads((results / "grpo_vs_trl.json").read_text())
    base = next(r for r in data["rows"] if r.get("row") == "calculator")
    row = dict(base, model_tokens_per_s_ratio=3.21, per_round_model_token_ratios=[3.05, 3.21, 3.4],
               speedup_vs_trl=2.5, per_round_ratios=[2.4, 2.5, 2.6])
    data["rows"] = [r for r in data["rows"] if r.get("row") != "calculator"] + [row]
    (results / "grpo_vs_trl.json").write_text(json.dumps(data))
    page = render((ROOT / "README.md").read_text())
    line = next(x for x in page.splitlines() if "against TRL's tool loop" in x)
    assert "model tokens/s **3.21×** (3.05 .. 3.40), episodes/s 2.50× (2.40 .. 2.60)" in line
