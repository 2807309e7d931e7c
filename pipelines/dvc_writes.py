"""What the flow adds around `dvc repro` of a stage: a failed write into DVC's cache fails the run (DVC itself
logs it and goes on as if stored), outputs a failed write left out of the cache are stored before the stage is
judged (so a rerun with room runs nothing again), and a stage killed by a signal is named by its signal."""

from __future__ import annotations

import contextlib
import json
import logging
import re
import signal
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def failed_cache_writes() -> Iterator[list[OSError]]:
    """The files DVC could not copy into its cache (a full device, a file too large for it, a cache not writable)
    while the body runs. DVC logs each as an error with a traceback and goes on as if stored; here each is
    collected instead (nothing printed), for the caller to fail the run on."""
    logger = logging.getLogger("dvc_data.hashfile.transfer")
    refused: list[OSError] = []

    def collect(record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        if record.levelno >= logging.ERROR and isinstance(error, OSError):
            refused.append(error)
            return False
        return True

    logger.addFilter(collect)
    try:
        yield refused
    finally:
        logger.removeFilter(collect)


def cache_write_text(stage: str, refused: list[OSError], root: str, cache_dir: str) -> str:
    """One line: which output DVC could not store, where, why, and what the rerun does."""
    first = refused[0]
    source = Path(first.filename or "?")
    try:
        source = source.resolve().relative_to(Path(root).resolve())
    except ValueError:
        pass
    outputs = sorted({str(out) for out in _outputs_of(stage, root) if str(source).startswith(out.rstrip("/"))})
    what = outputs[0] if outputs else str(source)
    return (f"{stage}: DVC could not store {what} in its cache {cache_dir} ({first.strerror or type(first).__name__}"
            f"{f'; {len(refused)} files' if len(refused) > 1 else ''}): the device is full, the file too large for "
            "it, or the cache not writable; the stage's work is kept in the workspace and dvc.lock: make room (or "
            "`dvc cache dir` elsewhere) and rerun: it is stored then, not run again")


def _outputs_of(stage: str, root: str) -> list[str]:
    from components.config.loading import safe_load

    entry = (safe_load((Path(root) / "dvc.yaml").read_text()) or {}).get("stages", {}).get(stage, {})
    return [item if isinstance(item, str) else next(iter(item))
            for section in ("outs", "metrics", "plots") for item in entry.get(section, []) or []]


UNSTORED = Path(".dvc") / "tmp" / "grpo-pipeline-unstored.json"  # stages whose outputs a failed write left out


def _unstored(path: Path) -> set[str]:
    """The stages in the note; none when it is missing or unreadable (a kill can only leave the previous note or the
    next whole: it is written in one rename)."""
    try:
        stages = json.loads(path.read_text())
    except (OSError, ValueError):
        return set()
    return {s for s in stages if isinstance(s, str)} if isinstance(stages, list) else set()


def remember_unstored(root: str, stage: str) -> None:
    """Note that DVC could not store `stage`'s outputs, for the next run to store them (and only then look)."""
    from components.data.records import write_text_atomic

    path = Path(root) / UNSTORED
    write_text_atomic(path, json.dumps(sorted(_unstored(path) | {stage})))


def store_outputs_missing_from_cache(repo, stage: str, root: str) -> list[str]:
    """After a failed write into DVC's cache (`remember_unstored`): `stage`'s outputs that match dvc.lock in the
    workspace while their copy is missing from the cache are stored, as `dvc commit` would; then the stage is up
    to date and is not run again. Nothing is done when anything else about the stage changed, nor for a stage no
    write failed for (collecting a stage from dvc.yaml is not free). Returns what was stored."""
    from components.data.records import write_text_atomic

    path = Path(root) / UNSTORED
    stages = _unstored(path)
    if stage not in stages:
        return []
    stages.discard(stage)
    write_text_atomic(path, json.dumps(sorted(stages)))
    found = repo.stage.collect(stage)
    if len(found) != 1:
        return []
    outs = found[0].outs
    missing = [o for o in outs if o.use_cache and o.hash_info and o.exists and o.changed_cache()]
    if not missing:  # the usual case, decided without hashing anything
        return []
    if found[0].changed_stage() or any(dep.changed() for dep in found[0].deps) \
            or any(o.workspace_status() for o in missing) or any(o.changed() for o in outs if o not in missing):
        return []
    repo.commit(stage, force=True)
    return [str(o) for o in missing]


def killed_by(err: BaseException) -> int | None:
    """The signal that ended the stage's command, from DVC's `exited with STATUS` (minus the signal, or 128 + it
    where a shell ran the command and did not exec it)."""


    while err is not None:
        found = re.search(r"exited with (-?\d+)", str(err))
        if found:
            status = int(found.group(1))
            signum = -status if status < 0 else status - 128 if 128 < status < 128 + 65 else 0
            return signum if signum in {s.value for s in signal.Signals} else None
        err = err.__cause__ or err.__context__
    return None
