"""Figures written by hand in README.md and docs/ that no results file holds.

    python benchmarks/doc_figures.py    # list them, page by page (exit 1 when there is one; a test runs this)

A figure is a number with a decimal point or a unit of measurement (s, ms, min, GB, GiB, %, x, tokens/s, ...),
outside the generated tables (benchmarks/render_results.py), code blocks with a language, inline code and link
targets; numbers right after a tool's name (versions) or "(default", "by default" (a setting), arXiv ids and numbers
in scientific notation (learning rates, thresholds) are not read as figures. Each paragraph names where its figures
come from: a results file (`benchmarks/results/NAME.json` or `.md`, linked or written out) or the benchmark that
writes it (`benchmarks/NAME.py`); a table, a list or a shown output also takes the sources of the paragraph before
it. A figure is held when one of its paragraph's results files has a value that shows as the same digits at the
page's precision (as a fraction for a percentage, in MiB for GiB, in seconds for minutes). HISTORY.md is a log, not
a results file. NOT_MEASUREMENTS lists the few numbers written like figures that are not measurements.
"""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "components" / "runtime" / "README.md"]

# Numbers written like figures that are not measurements: figure as written -> what it is.
NOT_MEASUREMENTS = {
    "95 %": "the confidence level of every interval",
    "3.11": "a Python version", "3.12": "a Python version",
}

UNIT = (r"(?:\s?(?:tokens/s|steps/s|completions/s|GFLOP/s|µs|ms|s|sec|seconds|min|minutes|h|hours|GB|GiB|MB|MiB|"
        r"KB|%)|×|x)(?![\w/])")
NUMBER = r"[+\-−]?\d[\d,]*(?:\.\d+)?"
FIGURE = re.compile(rf"(?<![\w.\-/@#=:^~])({NUMBER})(?:\s*(?:–|-|\.\.|to|/)\s*({NUMBER}))*({UNIT})?"
                    r"(?![A-Za-z])(?![\w.]*\d)")
CITED = re.compile(r"benchmarks/results/(\w+)\.(?:md|json)|benchmarks/(\w+)\.py")
ARXIV = re.compile(r"^\d{4}\.\d{4,5}$")
# A number right after one of these words is a version or a setting's default, not a measurement.
VERSION_OF = re.compile(r"(?:TRL|torch|PyTorch|Python|CUDA|MLflow|Prefect|DVC|transformers|version|[(,] ?default"
                        r"|by default|defaults to) $")


def _numbers(obj: Any) -> Iterator[float]:
    if isinstance(obj, bool):
        return
    if isinstance(obj, (int, float)):
        yield float(obj)
    elif isinstance(obj, str):
        yield from (float(m) for m in re.findall(r"\d+(?:\.\d+)?", obj.replace(",", "")))
    elif isinstance(obj, dict):
        for key, value in obj.items():
            yield from _numbers(key)
            yield from _numbers(value)
    elif isinstance(obj, list):
        for value in obj:
            yield from _numbers(value)


def held_values(name: str, results: Path = RESULTS) -> set[float]:
    """Every number in results file NAME (its JSON values and keys, and the numbers in its Markdown page)."""
    held: set[float] = set()
    if (results / f"{name}.json").exists():
        held.update(_numbers(json.loads((results / f"{name}.json").read_text())))
    if name != "HISTORY" and (results / f"{name}.md").exists():
        held.update(_numbers((results / f"{name}.md").read_text()))
    return held


def sources(paragraph: str, results: Path = RESULTS) -> set[str]:
    """The results files a paragraph names (a benchmark's name stands for the file it writes)."""
    names = {a or b for a, b in CITED.findall(paragraph)}
    return {n for n in names if n != "HISTORY" and ((results / f"{n}.json").exists() or (results / f"{n}.md").exists())}


def hand_written(text: str) -> str:
    """The page without what is not hand-written prose or tables: generated blocks, code, link targets."""
    text = re.sub(r"<!-- generated: [\w-]+ -->.*?<!-- end generated -->", "", text, flags=re.S)
    text = re.sub(r"^```\w+\n.*?^```$", "", text, flags=re.S | re.M)
    text = re.sub(r"`[^`\n]*`", "", text)
    return re.sub(r"\]\([^)\s]*\)", "]", text)


def figures(text: str) -> Iterator[str]:
    """The figures in a hand-written text, each as written (a range gives each end)."""
    text = hand_written(text)
    for match in FIGURE.finditer(text):
        if VERSION_OF.search(text[max(0, match.start() - 12):match.start()]):
            continue
        unit = (match.group(3) or "").strip()
        for number in re.findall(NUMBER, match.group(0)):
            if ARXIV.match(number) or number.count(".") > 1:
                continue
            if "." in number or unit:
                yield number + (f" {unit}" if unit else "")


def is_held(figure: str, held: set[float]) -> bool:
    number, _, unit = figure.partition(" ")
    digits = number.replace(",", "").replace("−", "-").lstrip("+-")
    decimals = len(digits.split(".")[1]) if "." in digits else 0
    value = float(digits)
    scales = {"%": (1, 100), "GiB": (1, 1 / 1024), "GB": (1, 1 / 1024, 1e-9), "min": (1, 1 / 60),
              "minutes": (1, 1 / 60), "s": (1, 60, 1e-3), "ms": (1, 1e3), "µs": (1, 1e6)}.get(unit, (1,))
    return any(round(abs(h) * k, decimals) == value for h in held for k in scales)


def paragraphs(text: str) -> Iterator[tuple[str, set[str]]]:
    """(paragraph, the results files it draws on) for each paragraph of a page outside its generated blocks."""
    text = re.sub(r"<!-- generated: [\w-]+ -->.*?<!-- end generated -->", "", text, flags=re.S)
    text = re.sub(r"^```\w+\n.*?^```$", "", text, flags=re.S | re.M)
    before: set[str] = set()
    for block in re.split(r"\n\s*\n", text):
        named = sources(block)
        if block.lstrip().startswith(("|", "- ", "* ", "```")):  # a table, list or output: read with what precedes it
            yield block, named | before
        else:
            yield block, named
            before = named


def unheld_in(text: str, cache: dict[str, set[float]] | None = None) -> list[str]:
    """The figures of a page's text that none of their paragraph's results files holds (NOT_MEASUREMENTS left out)."""
    cache = {} if cache is None else cache
    missing = []
    for block, names in paragraphs(text):
        held = set().union(*(cache.setdefault(n, held_values(n)) for n in names))
        missing += [f for f in figures(block) if f not in NOT_MEASUREMENTS and not is_held(f, held)]
    return missing


def unheld(pages: list[Path] = PAGES) -> dict[str, list[str]]:
    """page -> its figures that no results file of their paragraph holds."""
    cache: dict[str, set[float]] = {}
    found = {str(page.relative_to(ROOT)): unheld_in(page.read_text(), cache) for page in pages}
    return {page: missing for page, missing in found.items() if missing}


def main() -> int:
    found = unheld()
    for page, missing in found.items():
        print(f"{page}: {len(missing)} figures no results file of their paragraph holds: {', '.join(missing)}")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
