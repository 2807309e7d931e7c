"""Read and write datasets as JSONL records; hash files the way DVC does.

Records are dicts with `id`, `prompt`, `answer` plus any extra columns (passed to rewards).
Parse errors name the file and the 1-based line, before any training starts.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

REQUIRED_COLUMNS = ("id", "prompt", "answer")
SPLITS = ("sft", "train", "heldout")


class DataError(ValueError):
    """A dataset file cannot be read; the message names the file, the line and the rule."""


def iter_jsonl(path: str | Path) -> Iterator[tuple[int, dict[str, Any]]]:
    """Yield (line number, record) lazily, so large files never sit in memory whole."""
    path = Path(path)
    if not path.exists():
        raise DataError(f"{path}: file does not exist")
    if path.is_dir():
        raise DataError(f"{path}: is a directory, expected a JSONL file")
    with path.open("rb") as fh:
        for lineno, raw in enumerate(fh, start=1):
            try:
                line = raw.decode("utf-8-sig" if lineno == 1 else "utf-8")  # a byte-order mark, as Windows tools write
            except UnicodeDecodeError as err:
                raise DataError(f"{path}: line {lineno}: invalid UTF-8 ({err.reason} at byte {err.start})") from err
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise DataError(f"{path}: line {lineno}: malformed JSON ({err.msg})") from err
            if not isinstance(record, dict):
                raise DataError(f"{path}: line {lineno}: expected a JSON object, got {type(record).__name__}")
            yield lineno, record


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    """All records of a JSONL file; an empty file is an error (nothing to train or evaluate on)."""
    records = [record for _, record in iter_jsonl(path)]
    if not records:
        raise DataError(f"{path}: file is empty (no records)")
    return records


def write_jsonl(path: str | Path, records: list[dict[str, Any]]) -> None:
    """Write records atomically (temp file + rename), so a failed run never leaves half a file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    with tmp.open("w", encoding="utf-8") as fh:
        for record in records:
            fh.write(json.dumps(record, ensure_ascii=False, sort_keys=True) + "\n")
    tmp.replace(path)


def write_text_atomic(path: str | Path, text: str) -> None:
    """Replace a file's text in one rename, its bytes on disk first: a process killed while writing (or a machine
    lost) leaves the previous file or the new one, never part of one."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    with open(tmp, "w", encoding="utf-8") as fh:
        fh.write(text)
        fh.flush()
        os.fsync(fh.fileno())
    tmp.replace(path)


def file_md5(path: str | Path) -> str:
    """MD5 of a file's bytes: the hash DVC 3 records for a file output."""
    digest = hashlib.md5()
    with Path(path).open("rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def dir_md5(path: str | Path) -> str:
    """A content hash of a directory (relative names + file hashes), stable across machines."""
    root = Path(path)
    digest = hashlib.md5()
    for file in sorted(p for p in root.rglob("*") if p.is_file()):
        digest.update(f"{file.relative_to(root).as_posix()}:{file_md5(file)}\n".encode())
    return digest.hexdigest()


def normalise_prompt(text: Any) -> str:
    """Lower-cased, whitespace-collapsed prompt: catches leakage that differs only in spacing/case."""
    return " ".join(str(text).split()).lower()


def split_path(data_dir: str | Path, split: str) -> Path:
    """Where the pipeline keeps a prepared split."""
    return Path(data_dir) / f"{split}.jsonl"


def reward_columns(records: list[dict[str, Any]], group_size: int) -> dict[str, list[Any]]:
    """Every column except prompt, repeated per completion, passed to reward functions as keywords; and
    `group_index`, which completions share a prompt's group (the group rewards such as `distinct_ngrams` compare
    within, even when one prompt is drawn twice)."""
    keys = sorted({k for r in records for k in r} - {"prompt"})
    columns = {k: [r.get(k) for r in records for _ in range(group_size)] for k in keys}
    columns["group_index"] = [i for i in range(len(records)) for _ in range(group_size)]
    return columns
