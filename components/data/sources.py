"""Read users' datasets in the formats they arrive in, rename columns, and split deterministically.

Formats: JSONL, JSON (a list of records, or an object with a `prompts` list), CSV,
Parquet, and a Hugging Face `datasets` directory written by `save_to_disk`. Every error names the
file and, where there is one, the line or column.
"""

from __future__ import annotations

import csv
import json
import random
from pathlib import Path
from typing import Any

from components.data.records import DataError, normalise_prompt, read_jsonl

FORMATS = ("jsonl", "json", "csv", "parquet", "hf")


def detect_format(path: Path, declared: str = "auto") -> str:
    if declared != "auto":
        return declared
    if path.is_dir():
        if any((path / name).exists() for name in ("dataset_info.json", "state.json", "dataset_dict.json")):
            return "hf"
        raise DataError(f"{path}: a directory, but not a datasets save_to_disk folder (no dataset_info.json)")
    suffix = path.suffix.lower()
    for fmt, suffixes in {"jsonl": (".jsonl", ".ndjson"), "json": (".json",), "csv": (".csv",),
                          "parquet": (".parquet", ".pq")}.items():
        if suffix in suffixes:
            return fmt
    raise DataError(f"{path}: cannot tell the format from the extension '{suffix}'; set data.format")


def _read_json(path: Path) -> list[dict[str, Any]]:
    try:
        payload = json.loads(path.read_bytes().decode("utf-8-sig"))
    except UnicodeDecodeError as err:
        raise DataError(f"{path}: invalid UTF-8 at byte {err.start}") from err
    except json.JSONDecodeError as err:
        raise DataError(f"{path}: line {err.lineno}: malformed JSON ({err.msg})") from err
    if isinstance(payload, dict) and isinstance(payload.get("prompts"), list):
        payload = [p if isinstance(p, dict) else {"prompt": p} for p in payload["prompts"]]
    if not isinstance(payload, list):
        raise DataError(f"{path}: expected a list of records or an object with a 'prompts' list")
    for i, record in enumerate(payload, start=1):
        if not isinstance(record, dict):
            raise DataError(f"{path}: record {i}: expected an object, got {type(record).__name__}")
    return payload


def _read_csv(path: Path) -> list[dict[str, Any]]:
    try:
        text = path.read_bytes().decode("utf-8-sig")
    except UnicodeDecodeError as err:
        raise DataError(f"{path}: invalid UTF-8 at byte {err.start}") from err
    reader = csv.reader(text.splitlines())
    rows = list(reader)
    if not rows:
        return []
    header = rows[0]
    records = []
    for lineno, row in enumerate(rows[1:], start=2):
        if not row:
            continue
        if len(row) != len(header):
            raise DataError(f"{path}: line {lineno}: ragged row ({len(row)} fields, header has {len(header)})")
        records.append(dict(zip(header, row)))
    return records


def _read_parquet(path: Path, text_columns: list[str]) -> list[dict[str, Any]]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except (pa.ArrowInvalid, OSError) as err:
        raise DataError(f"{path}: not a readable Parquet file ({err})") from err
    for name in text_columns:
        if name in table.column_names:
            kind = table.schema.field(name).type
            if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)):
                raise DataError(f"{path}: column '{name}' has type {kind}, expected string")
    return table.to_pylist()


def _read_hf(path: Path) -> list[dict[str, Any]]:
    try:
        from datasets import DatasetDict, load_from_disk
    except ImportError as err:
        raise DataError(f"{path}: reading a datasets directory needs the 'datasets' package "
                        "(pip install -c constraints.txt -e '.[hf]')") from err
    dataset = load_from_disk(str(path))
    if isinstance(dataset, DatasetDict):
        raise DataError(f"{path}: holds several splits {list(dataset)}; point at one of them, e.g. {path}/train")
    return dataset.to_list()


def load_records(path: str | Path, declared_format: str = "auto",
                 columns: dict[str, str] | None = None) -> list[dict[str, Any]]:
    """Records from any supported format, with `columns` renames (source -> pipeline name) applied."""
    path = Path(path)
    if not path.exists():
        raise DataError(f"{path}: file does not exist")
    fmt = detect_format(path, declared_format)
    columns = columns or {}
    if fmt == "jsonl":
        records = read_jsonl(path)
    elif fmt == "json":
        records = _read_json(path)
    elif fmt == "csv":
        records = _read_csv(path)
    elif fmt == "parquet":
        sources = {target: source for source, target in columns.items()}
        records = _read_parquet(path, [sources.get("prompt", "prompt"), sources.get("answer", "answer")])
    else:
        records = _read_hf(path)
    if not records:
        raise DataError(f"{path}: file is empty (no records)")
    if columns:
        records = [{columns.get(k, k): v for k, v in r.items()} for r in records]
    require_prompt_column(path, records[0], columns)
    return records


def require_prompt_column(path: Path | str, first: dict[str, Any], columns: dict[str, str]) -> None:
    """A file without a `prompt` column (after renames) is refused here, naming its columns and the fix,
    before it could be split into nothing or validated as an empty file."""
    if "prompt" in first:
        return
    found = ", ".join(sorted(map(str, first))) or "none"
    guess = next((c for c in first if str(c).lower() in ("question", "input", "instruction", "query", "problem",
                                                          "text", "context")), None)
    example = f"data.columns: {{{guess}: prompt}}" if guess else "data.columns: {YOUR_COLUMN: prompt}"
    raise DataError(f"{path}: no 'prompt' column (columns: {found}); name the column that holds the prompts with "
                    f"{example}" + (f" (data.columns is {columns})" if columns else ""))


def ensure_ids(records: list[dict[str, Any]], split: str) -> bool:
    """Give records `<split>-<row>` ids when the source has no id column at all; returns whether it did."""
    if any("id" in r for r in records):
        return False
    for i, record in enumerate(records):
        record["id"] = f"{split}-{i:06d}"
    return True


def split_heldout(records: list[dict[str, Any]], ratio: float, seed: int) -> tuple[list[dict], list[dict]]:
    """Deterministic train/held-out split by prompt, so identical prompts never straddle the two."""
    keys = sorted({normalise_prompt(r.get("prompt")) for r in records})
    random.Random(seed).shuffle(keys)
    held = set(keys[: max(1, round(len(keys) * ratio))])
    train = [r for r in records if normalise_prompt(r.get("prompt")) not in held]
    heldout = [r for r in records if normalise_prompt(r.get("prompt")) in held]
    return train, heldout
