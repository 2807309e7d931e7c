"""Pull the final answer out of a completion: after `####`, inside the last `\\boxed{}`, the last
number, or the first group of a regex. Rewards take these as their `extract` option."""

from __future__ import annotations

import re

_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?|-?\.\d+")


def boxed(text: str) -> str | None:
    """Content of the last \\boxed{...} (or \\fbox{...}), braces balanced."""
    start = max(text.rfind("\\boxed{"), text.rfind("\\fbox{"))
    if start < 0:
        return None
    i = text.index("{", start) + 1
    depth, begin = 1, i
    while i < len(text) and depth:
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        i += 1
    return text[begin:i - 1].strip() if depth == 0 else None


def after_hashes(text: str) -> str | None:
    """GSM8K style: what follows the last `####`, up to the end of its line."""
    if "####" not in text:
        return None
    tail = text.rsplit("####", 1)[1].strip()
    return tail.splitlines()[0].strip() if tail else None


def last_number(text: str) -> str | None:
    found = _NUMBER.findall(text)
    return found[-1].replace(",", "") if found else None


def extract_answer(text: str, how: str | None) -> str | None:
    """`how`: None (the whole stripped text), `####`, `boxed`, `last_number`, or `regex:PATTERN`."""
    if how in (None, "", "none"):
        return text.strip()
    if how == "####":
        return after_hashes(text)
    if how == "boxed":
        return boxed(text)
    if how == "last_number":
        return last_number(text)
    if how.startswith("regex:"):
        match = None
        for found in re.finditer(how[len("regex:"):], text, re.DOTALL):
            match = found
        if match is None:
            return None
        return (match.group(1) if match.groups() else match.group(0)).strip()
    raise ValueError(f"unknown extract {how!r}: use ####, boxed, last_number or regex:PATTERN")
