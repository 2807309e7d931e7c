"""Stage `prepare`: generate the embedded task's splits, or import the user's datasets.

User files may be JSONL, JSON, CSV, Parquet or a `datasets` directory, with columns renamed by
`data.columns`. Given only a train file, the held-out split is cut from it (by prompt, seeded) and
SFT uses the rest. Outputs data/prepared/{sft,train,heldout}.jsonl and sources.json (which file
each split came from, so validation errors can name the user's own file).
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

from components.config import PipelineConfig
from components.data.paths import Paths
from components.data.records import SPLITS, DataError, file_md5, iter_jsonl, split_path, write_jsonl
from components.data.sources import ensure_ids, load_records, require_prompt_column, split_heldout
from components.data.tasks import TASKS
from components.stages.cli import stage_main


def streamable(cfg: PipelineConfig, path: str) -> bool:
    """JSONL files that need no split are copied line by line, never held in memory whole."""
    return Path(path).suffix.lower() in (".jsonl", ".ndjson") and cfg.data.format in ("auto", "jsonl")


def stream_copy(src: str, dst: Path, split: str, columns: dict[str, str]) -> str:
    """Copy a JSONL file record by record, renaming columns and generating ids when the source has none."""
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = dst.with_suffix(".jsonl.tmp")
    note, count = "", 0
    with tmp.open("w", encoding="utf-8") as out:
        generate_ids = None
        for _, record in iter_jsonl(src):
            record = {columns.get(k, k): v for k, v in record.items()}
            if count == 0:
                require_prompt_column(src, record, columns)
            if generate_ids is None:
                generate_ids = "id" not in record
                note = " (ids generated from row numbers)" if generate_ids else ""
            if generate_ids:
                record["id"] = f"{split}-{count:06d}"
            out.write(json.dumps(record, ensure_ascii=False, sort_keys=True) + "\n")
            count += 1
    if count == 0:
        tmp.unlink()
        raise DataError(f"{src}: file is empty (no records)")
    tmp.replace(dst)
    return f"{src}{note}"


def user_splits(cfg: PipelineConfig, streamed: set[str] = frozenset()) -> tuple[dict[str, list[dict]], dict[str, str]]:
    """The user's splits (those given, plus held-out / SFT derived from train) and their sources."""
    d = cfg.data
    read = {split: load_records(path, d.format, d.columns)
            for split, path in (("sft", d.sft_path), ("train", d.train_path), ("heldout", d.heldout_path))
            if path and split not in streamed}
    sources = {split: str(getattr(d, f"{split}_path")) for split in read}
    for split, records in read.items():  # before splitting: ids then name rows of the user's own file
        if ensure_ids(records, split):
            sources[split] += " (ids generated from row numbers)"
    if "train" in read and "heldout" not in read and "heldout" not in streamed:
        seed = cfg.seed if d.split_seed is None else d.split_seed
        read["train"], read["heldout"] = split_heldout(read["train"], d.heldout_ratio, seed)
        sources["heldout"] = f"{sources['train']} (held-out {d.heldout_ratio:g}, split seed {seed})"
        sources["train"] = f"{sources['train']} (remaining {1 - d.heldout_ratio:g})"
    if "train" in read and "sft" not in read and "sft" not in streamed:
        read["sft"] = [dict(r) for r in read["train"]]
        sources["sft"] = f"{sources['train']} (also used for SFT)"
    return read, sources


def prepare(cfg: PipelineConfig, paths: Paths = Paths()) -> dict[str, str]:
    """Write the three splits; returns split -> source (a user path or `generated:<task>`)."""
    d = cfg.data
    given = {"sft": d.sft_path, "train": d.train_path, "heldout": d.heldout_path}
    # Stream what needs no split; a train file that must also yield the held-out split is read whole.
    streamed = {split for split, path in given.items()
                if path and streamable(cfg, path) and not (split == "train" and not d.heldout_path)}
    stream_sources = {split: stream_copy(given[split], split_path(paths.data, split), split, d.columns)
                      for split in sorted(streamed)}
    if "train" in streamed and not d.sft_path:
        shutil.copyfile(split_path(paths.data, "train"), split_path(paths.data, "sft"))
        stream_sources["sft"] = f"{stream_sources['train']} (also used for SFT)"
    records, sources = user_splits(cfg, set(stream_sources))
    sources.update(stream_sources)
    if len(records) + len(stream_sources) < len(SPLITS):
        generated = TASKS[cfg.task.name](cfg.task, cfg.seed)
        for split in SPLITS:
            if split not in records and split not in stream_sources:
                records[split], sources[split] = generated[split], f"generated:{cfg.task.name}"
    for split in SPLITS:
        if split in records:
            write_jsonl(split_path(paths.data, split), records[split])
        print(f"prepare: {split}: from {sources[split]}")
    (paths.data / "sources.json").write_text(json.dumps(sources, indent=2, sort_keys=True) + "\n")
    from components.tracking.runs import stage_run

    with stage_run(cfg.tracking.experiment, "prepare") as run:
        run.set_tags({f"source.{split}": source for split, source in sources.items()})
        run.log_params({f"data.{split}.md5": file_md5(split_path(paths.data, split)) for split in SPLITS})
    return sources


def main(argv: list[str] | None = None) -> int:
    return stage_main("Generate or import the datasets.", prepare, argv)


if __name__ == "__main__":
    sys.exit(main())
