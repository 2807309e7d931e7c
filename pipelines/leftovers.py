"""What a run killed at any moment leaves behind in DVC's files, recovered by the next run before its first stage.

A SIGKILL (a preempted machine, the out-of-memory killer) runs no clean-up, and DVC writes its state in place:
`.dvc/tmp/rwlock` (which process reads or writes which stage's paths) keeps the entries of the killed process, or, when
the kill came while DVC rewrote it, half a JSON document or nothing, and every `dvc repro` after it stops with
"Unable to read RWLock-file ... JSON structure is corrupted"; `dvc.lock` can be cut short the same way. The next run
(holding the repository's run lock, so no other pipeline run is alive) recovers each in one line of its own, without
machine paths, before DVC reads them, so DVC's own `Process ... had been killed. Auto removed it from the lock file.`
warnings never come. A file a live process holds is never touched: an entry whose process lives (and started before
the file was last written: a pid reused after a reboot is not the writer) stays, and so does a damaged file whose
text names a live process, or while DVC's own guard lock (`.dvc/tmp/rwlock.lock`) is held.

DVC's repository lock (`.dvc/tmp/lock`) is a kernel lock (`zc.lockfile`): it dies with its process, whatever the file
holds, so nothing is left to recover (unless `core.hardlink_lock` is set, for NFS: DVC's lock files are then its own
and are left alone). The pipeline's own notes are recovered where they are read: the stage's note
(components/run_marker.py), the overrides' bookkeeping (pipelines/params_io.py `restore_own_settings`), the tracking
queue (components/tracking/outbox.py) and the open MLflow runs (pipelines/open_runs.py).
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path
from typing import Any

RWLOCK = Path(".dvc") / "tmp" / "rwlock"
RWLOCK_GUARD = Path(".dvc") / "tmp" / "rwlock.lock"
DVC_LOCK_FILE = Path("dvc.lock")


def recover_after_a_kill(root: Path) -> None:
    """A deployment's run (which took the run lock itself) starts as `grpo-pipeline run` does: the user's own
    params.yaml back when an earlier run's one-off overrides are still in it, and DVC's files a killed run left
    recovered, each said in one line."""
    from pipelines.params_io import restore_own_settings

    for line in restore_own_settings(root) + recover_leftovers(root):
        print(line)


def recover_leftovers(root: Path) -> list[str]:
    """Every DVC state file a killed run left, recovered; the lines to print (none when nothing was left)."""
    return recover_rwlock(root) + recover_dvc_lock_file(root)


def holder_alive(pid: int, written_at: float) -> bool:
    """Whether process `pid` lives and could have written a file last written at `written_at` (it started before):
    after a reboot pids start again, and a process given a dead run's pid (this one included) is not its writer."""
    import psutil

    try:
        return psutil.Process(pid).create_time() <= written_at + 1.0
    except psutil.NoSuchProcess:
        return False
    except psutil.Error:  # not ours to look at: alive, and not ours to judge
        return True


def _entries(lock: dict[str, Any]) -> list[tuple[str, str, dict[str, Any]]]:
    """(mode, path, {pid, cmd}) for every entry of a parsed rwlock."""
    out = []
    for path, info in (lock.get("write") or {}).items():
        out.append(("write", path, info))
    for path, infos in (lock.get("read") or {}).items():
        out += [("read", path, info) for info in infos]
    return out


def _parsed(text: str) -> dict[str, Any] | None:
    """The rwlock's content when it is whole and of DVC's shape, else None."""
    try:
        lock = json.loads(text)
    except ValueError:
        return None
    if not isinstance(lock, dict) or set(lock) - {"read", "write"}:
        return None
    try:
        entries = _entries(lock)
    except (AttributeError, TypeError):
        return None
    if all(isinstance(info, dict) and isinstance(info.get("pid"), int) for _, _, info in entries):
        return lock
    return None


def _guard(root: Path):
    """DVC's own guard of the rwlock file (the lock it takes while it edits it), or None while another holds it."""
    import zc.lockfile

    for _ in range(10):
        try:
            return zc.lockfile.LockFile(str(root / RWLOCK_GUARD))
        except zc.lockfile.LockError:
            time.sleep(0.1)
    return None


def recover_rwlock(root: Path) -> list[str]:
    """`.dvc/tmp/rwlock` after a kill: the entries of processes that are gone removed; a file cut short (empty, half a
    document, not DVC's shape) removed when no live process is named in it. One line, or none."""
    path = root / RWLOCK
    if not path.exists():
        return []
    guard = _guard(root)
    if guard is None:
        return [f"dvc: left {RWLOCK} alone: a live DVC process is editing it"]
    try:
        written_at = path.stat().st_mtime
        text = path.read_text(encoding="utf-8", errors="replace")
        lock = _parsed(text)
        if lock is None:
            return _remove_damaged(path, text, written_at)
        gone = [entry for entry in _entries(lock) if not holder_alive(entry[2]["pid"], written_at)]
        if not gone:
            return []
        for mode, where, info in gone:
            if mode == "write":
                del lock["write"][where]
            else:
                lock["read"][where].remove(info)
        lock = {mode: {k: v for k, v in lock.get(mode, {}).items() if v} for mode in ("read", "write")}
        _write(path, {mode: entries for mode, entries in lock.items() if entries})
        pids = sorted({info["pid"] for _, _, info in gone})
        return [f"dvc: removed {len(gone)} entr{'y' if len(gone) == 1 else 'ies'} of a killed run (pid "
                f"{', '.join(map(str, pids))}) from {RWLOCK}"]
    finally:
        guard.close()


def _remove_damaged(path: Path, text: str, written_at: float) -> list[str]:
    what = "empty" if not text.strip() else "cut short" if not text.rstrip().endswith("}") else "not DVC's format"
    named = sorted({int(p) for p in re.findall(r'"pid"\s*:\s*(\d+)', text)})
    living = [pid for pid in named if holder_alive(pid, written_at)]
    if living:
        return [f"dvc: left {RWLOCK} alone ({what}): it names a live process (pid {', '.join(map(str, living))})"]
    path.unlink()
    return [f"dvc: removed {RWLOCK} ({what}, left by a run killed while DVC wrote it; no live process holds it); DVC "
            "writes it afresh"]


def _write(path: Path, lock: dict[str, Any]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(lock), encoding="utf-8")
    tmp.replace(path)


def recover_dvc_lock_file(root: Path) -> list[str]:
    """`dvc.lock` that DVC cannot read (cut short while DVC rewrote it in place: text that is not YAML, or YAML that
    fails DVC's lock file schema, a stage cut after its name say): moved to logs/, so DVC rebuilds it; the stages that
    had finished come back from DVC's run cache without running again."""
    path = root / DVC_LOCK_FILE
    if not path.exists():
        return []
    from dvc.schema import COMPILED_LOCKFILE_SCHEMA
    from dvc.utils.serialize import parse_yaml

    text = path.read_text(encoding="utf-8", errors="replace")
    try:
        parsed = parse_yaml(text, str(DVC_LOCK_FILE))
        if isinstance(parsed, dict):
            COMPILED_LOCKFILE_SCHEMA(parsed)
            return []
    except Exception:  # noqa: BLE001 - DVC's YAMLFileCorruptedError or voluptuous' Invalid: what this recovers
        pass
    kept = root / "logs" / time.strftime("dvc.lock-cut-short-%Y%m%d-%H%M%S")
    kept.parent.mkdir(parents=True, exist_ok=True)
    path.replace(kept)
    return [f"dvc: {DVC_LOCK_FILE} was cut short by a kill while DVC wrote it (moved to {kept.relative_to(root)}); "
            "the stages that had finished come back from DVC's run cache"]
