"""Stage `prepare`: generate the embedded task's splits, or import the user's datasets.

User files may be JSONL, JSON, CSV, Parquet or a `datasets` directory, with columns renamed by
`data.columns`. Given only a train file, the held-out split is cut from it (by prompt, seeded) and
SFT uses the rest. Outputs data/prepared/{sft,train,heldout}.jsonl and sources.json (which file
each split came from, so validation errors can name the user's own file).
"""

from __future__ import annotations

import json
import sys

from components.config import PipelineConfig
from components.data import SPLITS, file_md5, split_path, write_jsonl
from components.paths import Paths
from components.sources import ensure_ids, load_records, split_heldout
from components.stage_cli import stage_main
from components.tasks import TASKS


def user_splits(cfg: PipelineConfig) -> tuple[dict[str, list[dict]], dict[str, str]]:
    """The user's splits (those given, plus held-out / SFT derived from train) and their sources."""
    d = cfg.data
    read = {split: load_records(path, d.format, d.columns)
            for split, path in (("sft", d.sft_path), ("train", d.train_path), ("heldout", d.heldout_path)) if path}
    sources = {split: str(getattr(d, f"{split}_path")) for split in read}
    for split, records in read.items():  # before splitting: ids then name rows of the user's own file
        if ensure_ids(records, split):
            sources[split] += " (ids generated from row numbers)"
    if "train" in read and "heldout" not in read:
        seed = cfg.seed if d.split_seed is None else d.split_seed
        read["train"], read["heldout"] = split_heldout(read["train"], d.heldout_ratio, seed)
        sources["heldout"] = f"{sources['train']} (held-out {d.heldout_ratio:g}, split seed {seed})"
        sources["train"] = f"{sources['train']} (remaining {1 - d.heldout_ratio:g})"
    if "train" in read and "sft" not in read:
        read["sft"] = [dict(r) for r in read["train"]]
        sources["sft"] = f"{sources['train']} (also used for SFT)"
    return read, sources


def prepare(cfg: PipelineConfig, paths: Paths = Paths()) -> dict[str, str]:
    """Write the three splits; returns split -> source (a user path or `generated:<task>`)."""
    records, sources = user_splits(cfg)
    if len(records) < len(SPLITS):
        generated = TASKS[cfg.task.name](cfg.task, cfg.seed)
        for split in SPLITS:
            if split not in records:
                records[split], sources[split] = generated[split], f"generated:{cfg.task.name}"
    for split in SPLITS:
        write_jsonl(split_path(paths.data, split), records[split])
        print(f"prepare: {split}: {len(records[split])} records from {sources[split]}")
    (paths.data / "sources.json").write_text(json.dumps(sources, indent=2, sort_keys=True) + "\n")
    from components.tracking import stage_run

    with stage_run(cfg.tracking.experiment, "prepare") as run:
        run.set_tags({f"source.{split}": source for split, source in sources.items()})
        run.log_params({f"data.{split}.md5": file_md5(split_path(paths.data, split)) for split in SPLITS})
    return sources


def main(argv: list[str] | None = None) -> int:
    return stage_main("Generate or import the datasets.", prepare, argv)


if __name__ == "__main__":
    sys.exit(main())
