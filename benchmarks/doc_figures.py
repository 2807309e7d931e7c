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
  fewer calls`, `three times as long` (not `written twice`, `half of its groups`); a multiple in digits: `28x`,
  `28 times TRL`;
- a percentage: `40%`, `40 percent`, `forty percent`; a number in words with a unit: `seventeen minutes`;
- in the user pages (README.md, docs/*.md, components/runtime/README.md), a count: a whole number, in digits or in
  words from eleven up (prose names parts in words: `two stages`), followed by a plural noun, at most two describing
  words between (`889 tests`, `12 rounds`, `twelve alternating rounds`). Not a count: a number after a label
  (`rank 0 logs`, `level 1 adds`), after "every" (a period, a setting), after an operator (`7 + 5 = 12 apples`,
  `16 prompts × 8 completions`), inside a quoted example (`"Ana has 7 apples"`), or one whose noun COUNTED_SETTINGS
  lists (what a user or the code chooses, not what a run measured: `16 prompts`, `128 tokens`, `30 layers`).
Settings written as settings are not figures: in inline code, right after "default" or before "by default", and in
a YAML comment the value of its own line; nor are versions (a number right after a tool's name, or a decimal with a
`+`: `6.2+`), seeds, arXiv ids, or numbers in scientific notation. NOT_MEASUREMENTS lists the few phrases written
like figures that are rules or definitions, each with what it is.

Each paragraph names where its figures come from: a results file (`benchmarks/results/NAME.json` or `.md`, linked or
written out) or the benchmark that writes it (`benchmarks/NAME.py`; a benchmark's own docstring draws on its own
results); a table, a list or a shown output also takes the sources of the paragraph before it. A figure is held when
one of those results files has a value that shows as the same digits at the text's precision (as a fraction for a
percentage, in MiB for GiB, in seconds for minutes). HISTORY.md is a changelog, not a results file. A figure that is
not held is reported with its file and line.
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
    "twice as far": "the fast path's self-check tolerance (engine/generation/fast/check.py)",
    "twice as long": "the `completion_length_growth` monitor's default threshold, 1.0",
    "a third": "`GROUP_ROWS_EXTRA_WORK`, a third of the break-even (engine/generation/fast/attention.py)",
}

# Nouns whose counts are chosen, not measured: a count of one of them is a setting or a definition, not a figure
# (noun -> what its count is). Only nouns every count of which on the pages is such a choice belong here.
COUNTED_SETTINGS = {
    "prompts": "a batch, group or evaluation size (params.yaml, configs/, a benchmark's options)",
    "steps": "a training length, an interval or a test's length (params.yaml, configs/, a benchmark's options)",
    "tokens": "a length budget or a prompt's length (params.yaml, configs/)",
    "episodes": "a group size in episodes (grpo.num_generations with tools)",
    "turns": "an episode's turn budget (grpo.episode.max_turns); \"0 turns it off\" is a verb",
    "epochs": "the warm start's epoch budget (sft.epochs)",
    "rows": "a batch's rows or a chunk's size (a setting or a constant of the code)",
    "layers": "a model's shape (its published config)",
    "bytes": "a number format's or an optimizer state's size, by definition",
    "cores": "the machine a result names",
    "threads": "torch's thread count (`threads`)",
    "processes": "a parallel setting (torchrun's --nproc-per-node)",
    "characters": "a limit the code sets (a truncation length)",
}

UNIT = (r"(?:\s?(?:tokens/s|steps/s|completions/s|GFLOP/s|µs|ms|s|sec|seconds|min|minutes|h|hours|GB|GiB|MB|MiB|"
        r"KB|%|percent|per cent|times)|×|x)(?![\w/])")
NUMBER = r"[+\-−]?\d[\d,]*(?:\.\d+)?"
RANGE_SEP = r"(?:–|-|\.\.|to|/)"
FIGURE = re.compile(rf"(?<![\w.\-/@#=:^~])({NUMBER})((?:\s*{RANGE_SEP}\s*{NUMBER})*)({UNIT})?"
                    r"(?![A-Za-z])(?![\w.]*\d)")
CITED = re.compile(r"benchmarks/results/(\w+)\.(?:md|json)|benchmarks/(\w+)\.py")
ARXIV = re.compile(r"^\d{4}\.\d{4,5}$")
# A number right after one of these words is a version, a setting's default or a seed, not a measurement.
VERSION_OF = re.compile(r"(?:TRL|torch|PyTorch|Python|Linux|CUDA|MLflow|Prefect|DVC|YAML|transformers|version"
                        r"|[(,] ?default|by default|defaults to|seeds?|seed \d+,|seeds \d+ and|Qwen2\.5-|Llama-)\s?$",
                        re.I)
SETTING_AFTER = re.compile(r"^\s*(?:by default|\(default\)|is the default)")
APPROX = re.compile(r"\b(?:about|some|nearly|roughly|around|almost|approximately)\s+$|~\s?$")
COUNT_OF = re.compile(r"(\d[\d,]*) of (?:the |its |their |all )?(\d[\d,]*)\b")
ONES = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "eleven", "twelve",
        "thirteen", "fourteen", "fifteen", "sixteen", "seventeen", "eighteen", "nineteen"]
TENS = ["twenty", "thirty", "forty", "fifty", "sixty", "seventy", "eighty", "ninety"]
# A whole number in words, zero to ninety-nine ("seventeen", "forty-two", "forty two").
NUMBER_WORD = rf"(?:(?:{'|'.join(TENS)})(?:[- ](?:{'|'.join(ONES[1:10])}))?|{'|'.join(reversed(ONES))})"
SPELLED = re.compile(rf"\b(half an?|an?|{NUMBER_WORD})\s+(minutes?|hours?|days?|seconds|percent|per cent)\b", re.I)
# Multiples and shares in words, where they compare quantities ("twice the rate", "half its completions", "a quarter
# fewer calls"), not where they count events ("written twice") or name a part ("half of its groups").
MULTIPLE = re.compile(r"(?<![-\w])(twice(?= (?:as|the|that|its|what)\b)|half(?= (?:the|its|as|their|what)\b)|"
                      r"(?:a third|a quarter|a fifth|two thirds|three quarters)"
                      r"(?= (?:of|the|as|fewer|more|less|its)\b)|"
                      r"(?:two|three|four|five|six|seven|eight|nine|ten) times(?= (?:as|the|faster|slower|more|less|"
                      r"longer|shorter)\b))", re.I)
MULTIPLE_VALUE = {"twice": 2, "half": 0.5, "a third": 1 / 3, "a quarter": 0.25, "a fifth": 0.2, "two thirds": 2 / 3,
                  "three quarters": 0.75}
# A count: a whole number (digits, or words from eleven up: "two stages" is how prose names parts) and a plural
# noun, at most two describing words between them.
SMALL_WORDS = "|".join(ONES[:11])
LINKING = (r"(?:and|or|of|to|for|if|only|the|a|an|in|on|at|by|with|when|where|than|then|is|are|was|were|be|most|"
           r"more|less|per|each|from|into|as|but|not|no|so|its|their|it|that|which)")
COUNT = re.compile(rf"(?<![\w.\-/@#=:^~+−×*$'])(?!(?:{SMALL_WORDS})\b)(\d+(?:,\d{{3}})*|{NUMBER_WORD})"
                   rf"(?![\w.,]*\d)(?![\w-])((?:[ \t]+(?!{LINKING}\b)[A-Za-z][\w-]*){{0,2}}?)[ \t\n]+"
                   r"([a-z][a-z-]*s)\b", re.I)
NOT_NOUN = {"is", "was", "has", "as", "its", "this", "plus", "less", "across", "always", "thus", "does", "yes", "us",
            "whereas", "unless", "times", "seconds", "minutes", "hours", "days", "percent", "sometimes", "perhaps",
            "besides", "whose", "chooses", "his", "hers", "ours", "yours", "theirs"}
# A number after one of these names an item (rank 0, level 1, the first 200) or a period (every 200 steps).
LABEL_BEFORE = re.compile(r"\b(?:level|rank|step|version|exit|code|status|seed|layer|round|call|stage|row|GPU|node|"
                          r"turn|line|phase|epoch|commit|port|issue|figure|table|section|item|number|id|every|first|"
                          r"last|top)\s+$", re.I)
# A number after an operator is a sum's result or a shape's factor (`7 + 5 = 12 apples`, `16 prompts × 8 completions`).
OPERATOR_BEFORE = re.compile(r"(?:[=+×*/−-]|\bx)\s*$")
QUOTED = re.compile(r"\"[^\"]*\"|“[^”]*”")  # within a paragraph


def word_value(word: str) -> int:
    """The value of a whole number in words (NUMBER_WORD; "a"/"an" are one)."""
    parts = re.split(r"[- ]", word.lower())
    if parts[0] in ("a", "an"):
        return 1
    if parts[0] in TENS:
        return 20 + 10 * TENS.index(parts[0]) + (ONES.index(parts[1]) if len(parts) > 1 else 0)
    return ONES.index(parts[0])


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


def _blank(match: re.Match) -> str:
    """What a removed block leaves: its line breaks, so that every line keeps its number."""
    return "\n" * match.group(0).count("\n")


def _without_blocks(text: str) -> str:
    """The text without its generated blocks and its code blocks with a language, lines kept."""
    text = re.sub(r"<!-- generated: [\w-]+ -->.*?<!-- end generated -->", _blank, text, flags=re.S)
    return re.sub(r"^```\w+\n.*?^```$", _blank, text, flags=re.S | re.M)


def hand_written(text: str) -> str:
    """The text without what is not hand-written prose or tables: generated blocks, code, link targets (every line
    keeps its number)."""
    text = re.sub(r"`[^`\n]*`", "", _without_blocks(text))
    return re.sub(r"\]\([^)\s]*\)", "]", text)


def _not_a_figure(text: str, start: int, end: int) -> bool:
    return bool(VERSION_OF.search(text[max(0, start - 16):start]) or SETTING_AFTER.match(text[end:end + 16]))


def _minimum_version(text: str, match: re.Match, number: str) -> bool:
    """Whether a decimal is written `N.N+`: a lowest version (`5.13+`), not a measurement."""
    return "." in number and match.group(0) == number and text[match.end():match.end() + 1] == "+"


def _numeric(text: str, settings: frozenset[float]) -> Iterator[tuple[int, str]]:
    """(offset, figure) of the numbers in digits that are figures: decimals, with a unit, ranges, approximate."""
    for match in FIGURE.finditer(text):
        if _not_a_figure(text, match.start(), match.end()):
            continue
        unit = (match.group(3) or "").strip()
        unit = "%" if unit in ("percent", "per cent") else unit
        ranged = bool(re.match(r"(?:–|-)\d|\s*(?:\.\.|to)\s*\d", match.group(2)))  # "12 - 3" is a sum
        approx = bool(APPROX.search(text[max(0, match.start() - 16):match.start()]))
        for number in re.findall(NUMBER, match.group(0)):
            if ARXIV.match(number) or number.count(".") > 1 or _minimum_version(text, match, number):
                continue
            if settings and float(number.replace(",", "").lstrip("+-−")) in settings:
                continue
            if "." in number or unit or ranged or approx:
                yield match.start(), number + (f" {unit}" if unit else "")


def _counts(text: str, settings: frozenset[float], taken: set[int]) -> Iterator[tuple[int, str]]:
    """(offset, "N noun") of the counts of a text (COUNT) that are figures: not at an offset another rule read, not a
    label's, an operator's or a quoted example's number, not a noun COUNTED_SETTINGS lists."""
    quoted = [m.span() for m in QUOTED.finditer(text)]
    for match in COUNT.finditer(text):
        start, noun = match.start(), match.group(3).lower()
        if start in taken or noun in NOT_NOUN or noun in COUNTED_SETTINGS or any(a < start < b for a, b in quoted):
            continue
        before = text[max(0, start - 16):start]
        if LABEL_BEFORE.search(before) or OPERATOR_BEFORE.search(before) or _not_a_figure(text, start, match.end(1)):
            continue
        number = match.group(1)
        value = float(number.replace(",", "")) if number[0].isdigit() else float(word_value(number))
        if value in settings:
            continue
        yield start, f"{number} {' '.join(match.group(2).split() + [match.group(3)])}"


def _found(text: str, settings: frozenset[float], counts: bool) -> Iterator[tuple[int, str]]:
    """(offset in hand_written(text), figure) of every figure of a text, rule by rule."""
    text = hand_written(text)
    numeric = list(_numeric(text, settings))
    yield from numeric
    for match in COUNT_OF.finditer(text):
        if not _not_a_figure(text, match.start(), match.end()):
            yield match.start(), f"{match.group(1)} of {match.group(2)}"
    spelled = [(m.start(), m.group(0)) for m in SPELLED.finditer(text)]
    yield from spelled
    yield from ((m.start(), m.group(0)) for m in MULTIPLE.finditer(text))
    if counts:
        taken = {offset for offset, _ in numeric + spelled}
        taken |= {m.start(g) for m in COUNT_OF.finditer(text) for g in (1, 2)}
        yield from _counts(text, settings, taken)


def figures(text: str, settings: frozenset[float] = frozenset(), counts: bool = True) -> Iterator[str]:
    """The figures in a hand-written text, each as written (a range gives each end; a percentage as `N %`; a count
    as `N noun`). `settings`: numbers that are the setting the text annotates (a YAML comment's own line); `counts`:
    whether counts are read (the user pages)."""
    return (figure for _, figure in _found(text, settings, counts))


def _value(figure: str) -> tuple[list[float], str, int]:
    """(the values a figure may stand for, its unit, its decimals)."""
    spelled = SPELLED.fullmatch(figure)
    if spelled:
        word = spelled.group(1).lower()
        unit = spelled.group(2).lower()
        value = 0.5 if word.startswith("half") else word_value(word)
        unit = {"minute": "min", "minutes": "min", "hour": "h", "hours": "h", "seconds": "s", "percent": "%",
                "per cent": "%"}.get(unit, unit)
        return [float(value)], unit, 0
    multiple = figure.lower()
    if multiple in MULTIPLE_VALUE or re.fullmatch(rf"{NUMBER_WORD} times", multiple):
        value = MULTIPLE_VALUE.get(multiple) or word_value(multiple.rsplit(" ", 1)[0])
        return [float(value)], "", 1
    if " of " in figure:
        a, b = (float(x.replace(",", "")) for x in figure.split(" of "))
        return [a, b], "of", 0
    number, _, unit = figure.partition(" ")
    if not number[0].isdigit() and number[0] not in "+-−":  # a count in words
        return [float(word_value(number))], "count", 0
    digits = number.replace(",", "").replace("−", "-").lstrip("+-")
    return [float(digits)], unit, len(digits.split(".")[1]) if "." in digits else 0


def is_held(figure: str, held: set[float]) -> bool:
    """Whether `held` (a results file's numbers) has every value of a figure at the figure's precision (a percentage
    also as a fraction, GiB in MiB, minutes in seconds, ...)."""
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
    return ((block, names) for block, names, _ in _paragraphs(text, own))


def _paragraphs(text: str, own: set[str], results: Path = RESULTS) -> Iterator[tuple[str, set[str], int]]:
    """paragraphs(), each with the number of its first line in `text` (from 1)."""
    text = _without_blocks(text)
    before: set[str] = set()
    offset = 0
    for separator in [*re.finditer(r"\n\s*\n", text), None]:
        end = separator.start() if separator else len(text)
        block, line = text[offset:end], text.count("\n", 0, offset) + 1
        offset = separator.end() if separator else end
        named = sources(block, results) | set(own)
        if block.lstrip().startswith(("|", "- ", "* ", "```")):  # a table, list or output: read with what precedes it
            yield block, named | before, line
        else:
            yield block, named, line
            before = named


def _unheld(block: str, names: set[str], cache: dict[str, set[float]], settings: frozenset[float],
            counts: bool, results: Path = RESULTS) -> list[tuple[int, str]]:
    """(line within the block, from 0; figure) of the block's figures that none of `names` holds."""
    held = set().union(*(cache.setdefault(n, held_values(n, results)) for n in names))
    written = hand_written(block)
    return [(written.count("\n", 0, offset), f) for offset, f in _found(block, settings, counts)
            if not _excused(f, block) and not is_held(f, held)]


def _excused(figure: str, block: str) -> bool:
    if figure in NOT_MEASUREMENTS:
        return True
    flat = " ".join(block.split())
    return any(phrase in flat and figure.lower() in phrase.lower() for phrase in NOT_MEASUREMENTS)


def unheld_lines(text: str, cache: dict[str, set[float]] | None = None, own: set[str] = frozenset(),
                 counts: bool = True, results: Path = RESULTS) -> list[tuple[int, str]]:
    """(line, from 1; figure) of the figures of a text that none of their paragraph's results files (in `results`)
    holds, NOT_MEASUREMENTS left out; `counts`: whether counts are read."""
    cache = {} if cache is None else cache
    missing = []
    for block, names, first in _paragraphs(text, own, results):
        missing += [(first + line, f) for line, f in _unheld(block, names, cache, frozenset(), counts, results)]
    return missing


def unheld_in(text: str, cache: dict[str, set[float]] | None = None, own: set[str] = frozenset(),
              counts: bool = True, results: Path = RESULTS) -> list[str]:
    """The figures of a text that none of their paragraph's results files holds (NOT_MEASUREMENTS left out)."""
    return [figure for _, figure in unheld_lines(text, cache, own, counts, results)]


def comments(text: str) -> Iterator[tuple[str, frozenset[float]]]:
    """(comment paragraph, the settings of its line) of a YAML file or Makefile: runs of whole-line comments, and
    each comment after a setting with the numbers of that setting's value."""
    return ((comment, settings) for comment, settings, _ in _comments(text))


def _comments(text: str) -> Iterator[tuple[str, frozenset[float], int]]:
    """comments(), each with the number of its first line (from 1)."""
    block: list[str] = []
    for number, line in enumerate(text.splitlines() + [""], start=1):
        stripped = line.strip()
        if stripped.startswith("#"):
            block.append(stripped.lstrip("#").strip())
            continue
        if block:
            yield "\n".join(block), frozenset(), number - len(block)
            block = []
        code, hash_, comment = _split_comment(line)
        if hash_:
            yield comment.strip(), frozenset(_numbers(re.findall(r"\d+(?:\.\d+)?", code))), number


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
    return (doc for doc, _ in _docstrings(source))


def _docstrings(source: str) -> Iterator[tuple[str, int]]:
    """docstrings(), each with the number of its first line in the module (from 1)."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node)
            if doc:
                raw = node.body[0].value.value.expandtabs().split("\n")
                dropped = next(i for i, line in enumerate(raw) if line.strip())  # cleandoc drops leading blank lines
                yield doc, node.body[0].lineno + dropped


def _own_results(path: Path) -> set[str]:
    """A benchmark's own results files (benchmarks/NAME.py writes benchmarks/results/NAME.*)."""
    return sources(f"benchmarks/{path.stem}.py") if path.parent == ROOT / "benchmarks" else set()


def unheld_in_file(path: Path, cache: dict[str, set[float]]) -> list[tuple[int, str]]:
    """(line, figure) of the unheld figures of one file: a page's text (counts read), a YAML file's or the
    Makefile's comments, a module's docstrings."""
    text = path.read_text()
    if path.suffix == ".md":
        return unheld_lines(text, cache)
    if path.suffix == ".py":
        return [(first + line - 1, f) for doc, first in _docstrings(text)
                for line, f in unheld_lines(doc, cache, _own_results(path), counts=False)]
    missing = []
    for comment, settings, first in _comments(text):
        missing += [(first + line, f) for line, f in _unheld(comment, sources(comment), cache, settings, False)]
    return missing


def _name(path: Path) -> str:
    """A file's path from the repository's root (as given, for a file outside it)."""
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def unheld(files: list[Path] | None = None) -> dict[str, list[str]]:
    """file -> `line N: FIGURE` for each of its figures that no results file of their paragraph holds."""
    cache: dict[str, set[float]] = {}
    files = files if files is not None else [*PAGES, *COMMENTED, *CODE]
    found = {_name(path): unheld_in_file(path, cache) for path in files}
    return {name: [f"line {line}: {figure}" for line, figure in missing] for name, missing in found.items() if missing}


def main() -> int:
    found = unheld()
    for name, missing in found.items():
        print(f"{name}: {len(missing)} figures no results file of their paragraph holds")
        print("".join(f"  {name}:{entry.removeprefix('line ')}\n" for entry in missing), end="")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
