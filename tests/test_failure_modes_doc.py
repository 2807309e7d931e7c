"""docs/failure-modes.md says for every row which test shows it, and every test it names exists."""

from __future__ import annotations

import re

from conftest import ROOT


def test_every_failure_mode_row_names_tests_that_exist():
    rows = [line for line in (ROOT / "docs" / "failure-modes.md").read_text().splitlines()
            if line.startswith("| ") and not line.startswith(("| what happens", "|---"))]
    defined = {name for path in (ROOT / "tests").rglob("test_*.py")
               for name in re.findall(r"^def (test_\w+)", path.read_text(), re.M)}
    files = {str(path.relative_to(ROOT)) for path in (ROOT / "tests").rglob("test_*.py")}
    assert len(rows) >= 20
    for row in rows:
        shown_by = row.rstrip(" |").rsplit(" | ", 1)[-1]
        named = re.findall(r"`(test_\w+)", shown_by) + re.findall(r"`(tests/[\w/]+\.py)`", shown_by)
        assert named, f"a row without its test: {row[:100]}"
        missing = [n for n in named if n not in defined and n not in files]
        assert not missing, f"{missing} named in docs/failure-modes.md do not exist"
