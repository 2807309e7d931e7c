"""Stage `prepare`: generate the embedded task's splits, or import the user's JSONL files.

Outputs data/prepared/{sft,train,heldout}.jsonl and sources.json (which file each split came from,
so validation errors can name the user's own file).
"""

from __future__ import annotations

import json
import sys

from components.config import PipelineConfig
from components.data import SPLITS, file_md5, read_jsonl, split_path, write_jsonl
from components.paths import Paths
from components.stage_cli import stage_main
from components.tasks import TASKS


def prepare(cfg: PipelineConfig, paths: Paths = Paths()) -> dict[str, str]:
    """Write the three splits; returns split -> source (a user path or `generated:<task>`)."""
    user_paths = {split: getattr(cfg.data, f"{split}_path") for split in SPLITS}
    generated = None
    if not all(user_paths.values()):
        generated = TASKS[cfg.task.name](cfg.task, cfg.seed)
    sources: dict[str, str] = {}
    for split in SPLITS:
        if user_paths[split]:
            records, sources[split] = read_jsonl(user_paths[split]), str(user_paths[split])
        else:
            records, sources[split] = generated[split], f"generated:{cfg.task.name}"
        write_jsonl(split_path(paths.data, split), records)
        print(f"prepare: {split}: {len(records)} records from {sources[split]}")
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
