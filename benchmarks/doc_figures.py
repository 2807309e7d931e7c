"""Figures written by hand that no results file holds, in every text a user reads as a statement of fact: README.md,
docs/*.md, components/runtime/README.md, the comments of params.yaml, configs/**/*.yaml and the Makefile, and the
docstrings of the project's Python code (components/, pipelines/, benchmarks/ and the scripts in tests/).

    python benchmarks/doc_figures.py    # list them, file by file (exit 1 when there is one; a test runs this)

A figure, outside generated tables (benchmarks/render_results.py), code blocks with a language, inline code and link
targets, is any of:
- a number with a decimal point;
- a number with a unit of measurement (s, ms, min, minutes, h, GB, GiB, MB, %, ×, x, times, tokens/s, ...), the
  number also spelled out (`about a minute`, `five minutes`);
- a range of whole numbers (`6-10`, `43–50`), a count out of another (`15 of the 16`), and a number after "about",
  "some", "nearly", "roughly", "around", "almost" or "~" (an approximate number is a measured one);
- a multiple or share in words where it compares quantities: `twice the rate`, `half its completions`, `a quarter
  fewer calls`, `three times as long` (not `written twice`, `half of its groups`).
Settings written as settings are not figures: in inline code, right after "default" or before "by default", and in
a YAML comment the value of its own line; nor are versions (a number right after a tool's name), seeds, arXiv ids,
or numbers in scientific notation. NOT_MEASUREMENTS lists the few phrases written like figures that are rules or
definitions, each with what it is.

Each paragraph names where its figures come from: a results file (`benchmarks/results/NAME.json` or `.md`, linked or
written out) or the benchmark that writes it (`benchmarks/NAME.py`; a benchmark's own docstring draws on its own
results); a table, a list or a shown output also takes the sources of the paragraph before it. A figure is held when
one of those results files has a value that shows as the same digits at the text's precision (as a fraction for a
percentage, in MiB for GiB, in seconds for minutes). HISTORY.md is a changelog, not a results file.
"""

from __future__ import annotations

import ast
import json
import re
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "components" / "runtime" / "README.md"]
COMMENTED = [ROOT / "params.yaml", *sorted((ROOT / "configs").rglob("*.yaml")), ROOT / "Makefile"]
# Test modules are left out: their docstrings state the inputs the test itself holds. The scripts in tests/ are read.
# Hidden folders are not the project's code: a benchmark's scratch clones (benchmarks/.work/) hold copies of it.
CODE = sorted([*(p for folder in ("components", "pipelines", "benchmarks") for p in (ROOT / folder).rglob("*.py")
                 if not any(part.startswith(".") for part in p.relative_to(ROOT).parts)),
               ROOT / "tests" / "mutation_check.py", ROOT / "tests" / "suite_timing.py"])

# Phrases written like figures that are not measurements: as written -> what it is.
NOT_MEASUREMENTS = {
    "95 %": "the confidence level of every interval",
    "3.11": "a Python version", "3.12": "a Python version",
    "half the free memory": "the rule of `gradient_checkpointing: auto` (engine/grpo/memory_estimate.py)",
    "twice as far": "the fast path's self-check tolerance (engine/fast/check.py)",
    "twice as long": "the `completion_length_growth` monitor's default threshold, 1.0",
    "a third": "`GROUP_ROWS_EXTRA_WORK`, a third of the break-even (engine/fast/attention.py)",
}

UNIT = (r"(?:\s?(?:tokens/s|steps/s|completions/s|GFLOP/s|µs|ms|s|sec|seconds|min|minutes|h|hours|GB|GiB|MB|MiB|"
        r"KB|%|times)|×|x)(?![\w/])")
NUMBER = r"[+\-−]?\d[\d,]*(?:\.\d+)?"
RANGE_SEP = r"(?:–|-|\.\.|to|/)"
FIGURE = re.compile(rf"(?<![\w.\-/@#=:^~])({NUMBER})((?:\s*{RANGE_SEP}\s*{NUMBER})*)({UNIT})?"
                    r"(?![A-Za-z])(?![\w.]*\d)")
CITED = re.compile(r"benchmarks/results/(\w+)\.(?:md|json)|benchmarks/(\w+)\.py")
ARXIV = re.compile(r"^\d{4}\.\d{4,5}$")
# A number right after one of these words is a version, a setting's default or a seed, not a measurement.
VERSION_OF = re.compile(r"(?:TRL|torch|PyTorch|Python|CUDA|MLflow|Prefect|DVC|YAML|transformers|version|[(,] ?default"
                        r"|by default|defaults to|seeds?|seed \d+,|seeds \d+ and|Qwen2\.5-|Llama-)\s?$", re.I)
SETTING_AFTER = re.compile(r"^\s*(?:by default|\(default\)|is the default)")
APPROX = re.compile(r"\b(?:about|some|nearly|roughly|around|almost|approximately)\s+$|~\s?$")
COUNT_OF = re.compile(r"(\d[\d,]*) of (?:the |its |their |all )?(\d[\d,]*)\b")
WORDS = {"a": 1, "an": 1, "one": 1, "two": 2, "three": 3, "four": 4, "five": 5, "six": 6, "seven": 7, "eight": 8,
         "nine": 9, "ten": 10, "eleven": 11, "twelve": 12, "fifteen": 15, "twenty": 20, "thirty": 30, "forty": 40,
         "fifty": 50, "sixty": 60, "ninety": 90}
SPELLED = re.compile(r"\b(half an?|" + "|".join(WORDS) + r")\s+(minutes?|hours?|days?|seconds)\b", re.I)
# Multiples and shares in words, where they compare quantities ("twice the rate", "half its completions", "a quarter
# fewer calls"), not where they count events ("written twice") or name a part ("half of its groups").
MULTIPLE = re.compile(r"(?<![-\w])(twice(?= (?:as|the|that|its|what)\b)|half(?= (?:the|its|as|their|what)\b)|"
                      r"(?:a third|a quarter|a fifth|two thirds|three quarters)"
                      r"(?= (?:of|the|as|fewer|more|less|its)\b)|"
                      r"(?:two|three|four|five|six|seven|eight|nine|ten) times(?= (?:as|the|faster|slower|more|less|"
                      r"longer|shorter)\b))", re.I)
MULTIPLE_VALUE = {"twice": 2, "half": 0.5, "a third": 1 / 3, "a quarter": 0.25, "a fifth": 0.2, "two thirds": 2 / 3,
                  "three quarters": 0.75}


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
    """The text without what is not hand-written prose or tables: generated blocks, code, link targets."""
    text = re.sub(r"<!-- generated: [\w-]+ -->.*?<!-- end generated -->", "", text, flags=re.S)
    text = re.sub(r"^```\w+\n.*?^```$", "", text, flags=re.S | re.M)
    text = re.sub(r"`[^`\n]*`", "", text)
    return re.sub(r"\]\([^)\s]*\)", "]", text)


def _not_a_figure(text: str, start: int, end: int) -> bool:
    return bool(VERSION_OF.search(text[max(0, start - 16):start]) or SETTING_AFTER.match(text[end:end + 16]))


def figures(text: str, settings: frozenset[float] = frozenset()) -> Iterator[str]:
    """The figures in a hand-written text, each as written (a range gives each end). `settings`: numbers that are
    the setting the text annotates (a YAML comment's own line)."""
    text = hand_written(text)
    for match in FIGURE.finditer(text):
        if _not_a_figure(text, match.start(), match.end()):
            continue
        unit = (match.group(3) or "").strip()
        ranged = bool(re.match(r"(?:–|-)\d|\s*(?:\.\.|to)\s*\d", match.group(2)))  # "12 - 3" is a sum
        approx = bool(APPROX.search(text[max(0, match.start() - 16):match.start()]))
        for number in re.findall(NUMBER, match.group(0)):
            if ARXIV.match(number) or number.count(".") > 1:
                continue
            if settings and float(number.replace(",", "").lstrip("+-−")) in settings:
                continue
            if "." in number or unit or ranged or approx:
                yield number + (f" {unit}" if unit else "")
    for match in COUNT_OF.finditer(text):
        if not _not_a_figure(text, match.start(), match.end()):
            yield f"{match.group(1)} of {match.group(2)}"
    for match in SPELLED.finditer(text):
        yield match.group(0)
    for match in MULTIPLE.finditer(text):
        yield match.group(0)


def _value(figure: str) -> tuple[list[float], str, int]:
    """(the values a figure may stand for, its unit, its decimals)."""
    spelled = SPELLED.fullmatch(figure)
    if spelled:
        word = spelled.group(1).lower()
        unit = spelled.group(2).lower()
        value = 0.5 if word.startswith("half") else WORDS[word]
        unit = {"minute": "min", "minutes": "min", "hour": "h", "hours": "h", "seconds": "s"}.get(unit, unit)
        return [float(value)], unit, 0
    multiple = figure.lower()
    if multiple in MULTIPLE_VALUE or multiple.endswith(" times"):
        value = MULTIPLE_VALUE.get(multiple) or WORDS[multiple.split()[0]]
        return [float(value)], "", 1
    if " of " in figure:
        a, b = (float(x.replace(",", "")) for x in figure.split(" of "))
        return [a, b], "of", 0
    number, _, unit = figure.partition(" ")
    digits = number.replace(",", "").replace("−", "-").lstrip("+-")
    return [float(digits)], unit, len(digits.split(".")[1]) if "." in digits else 0


def is_held(figure: str, held: set[float]) -> bool:
    values, unit, decimals = _value(figure)
    if unit == "of":
        return all(v in held for v in values)
    scales = {"%": (1, 100), "GiB": (1, 1 / 1024), "GB": (1, 1 / 1024, 1e-9), "min": (1, 1 / 60),
              "minutes": (1, 1 / 60), "h": (1, 1 / 3600), "hours": (1, 1 / 3600), "s": (1, 60, 1e-3),
              "ms": (1, 1e3), "µs": (1, 1e6)}.get(unit, (1,))
    return all(any(round(abs(h) * k, decimals) == round(v, decimals) for h in held for k in scales) for v in values)


def paragraphs(text: str, own: set[str] = frozenset()) -> Iterator[tuple[str, set[str]]]:
    """(paragraph, the results files it draws on) for each paragraph of a text outside its generated blocks; `own`:
    results files every paragraph draws on (a benchmark's own, in its docstring)."""
    text = re.sub(r"<!-- generated: [\w-]+ -->.*?<!-- end generated -->", "", text, flags=re.S)
    text = re.sub(r"^```\w+\n.*?^```$", "", text, flags=re.S | re.M)
    before: set[str] = set()
    for block in re.split(r"\n\s*\n", text):
        named = sources(block) | set(own)
        if block.lstrip().startswith(("|", "- ", "* ", "```")):  # a table, list or output: read with what precedes it
            yield block, named | before
        else:
            yield block, named
            before = named


def _unheld(block: str, names: set[str], cache: dict[str, set[float]], settings: frozenset[float]) -> list[str]:
    held = set().union(*(cache.setdefault(n, held_values(n)) for n in names))
    return [f for f in figures(block, settings) if not _excused(f, block) and not is_held(f, held)]


def _excused(figure: str, block: str) -> bool:
    if figure in NOT_MEASUREMENTS:
        return True
    flat = " ".join(block.split())
    return any(phrase in flat and figure.lower() in phrase.lower() for phrase in NOT_MEASUREMENTS)


def unheld_in(text: str, cache: dict[str, set[float]] | None = None, own: set[str] = frozenset()) -> list[str]:
    """The figures of a text that none of their paragraph's results files holds (NOT_MEASUREMENTS left out)."""
    cache = {} if cache is None else cache
    missing = []
    for block, names in paragraphs(text, own):
        missing += _unheld(block, names, cache, frozenset())
    return missing


def comments(text: str) -> Iterator[tuple[str, frozenset[float]]]:
    """(comment paragraph, the settings of its line) of a YAML file or Makefile: runs of whole-line comments, and
    each comment after a setting with the numbers of that setting's value."""
    block: list[str] = []
    for line in text.splitlines() + [""]:
        stripped = line.strip()
        if stripped.startswith("#"):
            block.append(stripped.lstrip("#").strip())
            continue
        if block:
            yield "\n".join(block), frozenset()
            block = []
        code, hash_, comment = _split_comment(line)
        if hash_:
            yield comment.strip(), frozenset(_numbers(re.findall(r"\d+(?:\.\d+)?", code)))


def _split_comment(line: str) -> tuple[str, str, str]:
    """(code, "#", comment) of a line, a '#' inside quotes not counted."""
    quote = None
    for i, char in enumerate(line):
        if char in "\"'" and quote in (None, char):
            quote = None if quote else char
        elif char == "#" and quote is None and (i == 0 or line[i - 1].isspace()):
            return line[:i], "#", line[i + 1:]
    return line, "", ""


def docstrings(source: str) -> Iterator[str]:
    """The docstrings of a Python module, its classes and functions."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node)
            if doc:
                yield doc


def _own_results(path: Path) -> set[str]:
    """A benchmark's own results files (benchmarks/NAME.py writes benchmarks/results/NAME.*)."""
    return sources(f"benchmarks/{path.stem}.py") if path.parent == ROOT / "benchmarks" else set()


def unheld_in_file(path: Path, cache: dict[str, set[float]]) -> list[str]:
    """The unheld figures of one file: a page's text, a YAML file's or the Makefile's comments, a module's
    docstrings."""
    text = path.read_text()
    if path.suffix == ".md":
        return unheld_in(text, cache)
    if path.suffix == ".py":
        return [f for doc in docstrings(text) for f in unheld_in(doc, cache, _own_results(path))]
    missing = []
    for comment, settings in comments(text):
        missing += _unheld(comment, sources(comment), cache, settings)
    return missing


def unheld(files: list[Path] | None = None) -> dict[str, list[str]]:
    """file -> its figures that no results file of their paragraph holds."""
    cache: dict[str, set[float]] = {}
    files = files if files is not None else [*PAGES, *COMMENTED, *CODE]
    found = {str(path.relative_to(ROOT)): unheld_in_file(path, cache) for path in files}
    return {name: missing for name, missing in found.items() if missing}


def main() -> int:
    found = unheld()
    for name, missing in found.items():
        print(f"{name}: {len(missing)} figures no results file of their paragraph holds: {', '.join(missing)}")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
