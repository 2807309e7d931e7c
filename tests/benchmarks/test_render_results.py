"""The README's results tables are generated from benchmarks/results/*.json: a page that disagrees fails here."""

from __future__ import annotations

import json

from benchmarks.render_results import PAGES, TABLES, render

from conftest import ROOT


def test_every_generated_table_matches_its_results_file():
    for page in PAGES:
        text = page.read_text()
        assert all(f"<!-- generated: {name} -->" in text for name in TABLES), page
        assert render(text) == text, f"{page.name} disagrees with benchmarks/results: run benchmarks/render_results.py"


def test_a_changed_figure_changes_the_page(tmp_path, monkeypatch):
    import benchmarks.render_results as rr

    results = tmp_path / "results"
    results.mkdir()
    for f in (ROOT / "benchmarks" / "results").glob("*.json"):
        (results / f.name).write_text(f.read_text())
    data = json.loads((results / "grpo_vs_trl.json").read_text())
    data["rows"][0]["speedup_vs_trl"] = 1.23
    (results / "grpo_vs_trl.json").write_text(json.dumps(data))
    monkeypatch.setattr(rr, "RESULTS", results)
    readme = (ROOT / "README.md").read_text()
    assert render(readme) != readme and "**1.23×**" in render(readme)
