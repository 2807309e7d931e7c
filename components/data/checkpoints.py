"""Atomic, resumable training checkpoints (safetensors weights, weights_only state).

A checkpoint is written under a temporary name and renamed when complete, so a kill or a full disk
mid-write never leaves a corrupt "latest": the previous checkpoint survives intact. Each carries the
hash of the inputs it was trained from; a checkpoint from other inputs is never resumed. Its meta.json,
written last, also holds the sha256 of every other file: a checkpoint damaged afterwards (a disk error, a
truncated copy) is skipped on resume, with one line saying why, for the newest intact one.

checkpoints/grpo holds the checkpoints of the inputs being trained; those of other inputs are set aside, not
removed (`set_aside_other_inputs`: checkpoints/grpo-other-inputs/<inputs hash>/, the `KEEP_OTHER_INPUTS` most
recently set aside), and come back when their inputs are trained again: going back to settings a run was
interrupted on resumes it. Not a DVC output: DVC's run cache (which brings a finished stage's result back when
its inputs come back) takes no stage with a persistent output, and these are the resume state of unfinished
runs, not a result.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

PREFIX = "step-"
KEEP = 2
KEEP_OTHER_INPUTS = 3  # sets of checkpoints of other inputs kept aside (each up to KEEP steps and `best`)
OTHER_INPUTS = "-other-inputs"  # checkpoints/grpo -> checkpoints/grpo-other-inputs/<inputs hash>/


class CheckpointWriteError(RuntimeError):
    """A checkpoint could not be written (disk full, permissions); the previous one is intact."""


def _step_dirs(root: Path) -> list[Path]:
    if not root.exists():
        return []
    return sorted((p for p in root.iterdir() if p.is_dir() and p.name.startswith(PREFIX)),
                  key=lambda p: int(p.name[len(PREFIX):]))


def newest_step(root: Path) -> int | None:
    """The step of the newest checkpoint in `root` (complete: each is renamed into place once written), if any."""
    steps = _step_dirs(root)
    return int(steps[-1].name[len(PREFIX):]) if steps else None


TRAINABLE_FILE = "trainable.safetensors"  # LoRA runs: only the adapter weights (the base never changes)


def save_checkpoint(root: Path, step: int, run_hash: str, model, optimizer, state: dict[str, Any],
                    reference=None) -> Path:
    """Write step `step` atomically and keep only the newest `KEEP` checkpoints."""
    from safetensors.torch import save_model

    root.mkdir(parents=True, exist_ok=True)
    final = root / f"{PREFIX}{step:07d}"
    tmp = root / f".tmp-{PREFIX}{step:07d}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir()
        _save_weights(model, tmp)
        if reference is not None:
            save_model(reference, str(tmp / "reference.safetensors"))
        import torch  # here, not at module level: the stage CLI imports this module's error class

        torch.save({"optimizer": optimizer.state_dict(), **state}, tmp / "state.pt")
        files = {p.name: _sha256(p) for p in sorted(tmp.iterdir())}
        (tmp / "meta.json").write_text(json.dumps({"step": step, "run_hash": run_hash, "files": files}) + "\n")
        shutil.rmtree(final, ignore_errors=True)
        tmp.rename(final)
    except Exception as err:
        shutil.rmtree(tmp, ignore_errors=True)
        previous = _step_dirs(root)
        kept = f"previous checkpoint {previous[-1]} kept" if previous else "no earlier checkpoint"
        free = shutil.disk_usage(root).free / 2**30
        raise CheckpointWriteError(f"could not write checkpoint step {step} in {root} ({type(err).__name__}: "
                                   f"{str(err).splitlines()[0][:200]}): the device is full, the file too large for "
                                   f"it, or the directory not writable ({free:.1f} GB free there); {kept}; make room "
                                   "and rerun to resume") from err
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    for old in _step_dirs(root)[:-KEEP]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def _sha256(path: Path) -> str:
    with path.open("rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _meta(path: Path) -> dict[str, Any] | None:
    """A checkpoint's meta.json, or None when it is missing or unreadable (a damaged checkpoint)."""
    try:
        return json.loads((path / "meta.json").read_text())
    except (OSError, ValueError):
        return None


def damage(path: Path) -> str | None:
    """Why checkpoint `path` cannot be trusted (a file missing or not matching its recorded sha256), or None.
    Checkpoints written before checksums were recorded are trusted as they are."""
    meta = _meta(path)
    if meta is None:
        return "its meta.json is missing or unreadable"
    for name, digest in (meta.get("files") or {}).items():
        file = path / name
        if not file.is_file():
            return f"{name} is missing"
        if _sha256(file) != digest:
            return f"{name} does not match its recorded sha256 (damaged or cut short)"
    return None


def latest_checkpoint(root: Path, run_hash: str, say: Callable[[str], Any] = print,
                      remove_damaged: bool = False) -> Path | None:
    """The newest intact checkpoint trained from the same inputs, if any; damaged ones are skipped, each said
    (and removed with `remove_damaged`: the resumed run rewrites those steps, and a damaged newer checkpoint
    left in place would push the fresh ones out of the `KEEP` newest)."""
    for path in reversed(_step_dirs(root)):
        meta = _meta(path)
        if meta is not None and meta.get("run_hash") != run_hash:
            continue
        why = damage(path)
        if why is None:
            return path
        if remove_damaged:
            shutil.rmtree(path, ignore_errors=True)
        say(f"grpo: skipped checkpoint {path}: {why}" + ("; removed it" if remove_damaged else ""))
    return None


def set_aside_other_inputs(root: Path, run_hash: str, say: Callable[[str], Any] = print) -> None:
    """Make `root` hold this run's checkpoints only, each move said in one line: half-written ones (`.tmp-*`, left
    by a kill mid-write) are removed; those of other inputs are set aside under their inputs' hash (never resumed
    by this run, kept for theirs); this run's, set aside by an earlier run of other inputs, come back. One whose
    meta.json is unreadable stays for `latest_checkpoint` to report as damaged."""
    aside = root.with_name(root.name + OTHER_INPUTS)
    for path in sorted(root.iterdir()) if root.exists() else []:
        if not path.is_dir():
            continue
        if path.name.startswith(".tmp-"):
            shutil.rmtree(path, ignore_errors=True)
            say(f"grpo: removed {path}: a checkpoint whose writing was cut off (half-written, never resumed)")
            continue
        meta = _meta(path)
        if meta is None or meta.get("run_hash") == run_hash:
            continue
        target = aside / str(meta.get("run_hash"))[:16] / path.name
        shutil.rmtree(target, ignore_errors=True)
        target.parent.mkdir(parents=True, exist_ok=True)
        path.rename(target)
        os.utime(target.parent)  # most recently set aside: kept longest
        say(f"grpo: set aside checkpoint {path} (trained from other inputs) as {target}; a run of those inputs "
            "resumes from it")
    mine = aside / run_hash[:16]
    if mine.is_dir():
        root.mkdir(parents=True, exist_ok=True)
        for path in sorted(mine.iterdir()):
            if not (root / path.name).exists():
                path.rename(root / path.name)
                say(f"grpo: brought back checkpoint {root / path.name} of these inputs (set aside by a run of others)")
        shutil.rmtree(mine, ignore_errors=True)
    sets = sorted((p for p in aside.iterdir() if p.is_dir()), key=lambda p: p.stat().st_mtime) if aside.is_dir() else []
    for old in sets[:-KEEP_OTHER_INPUTS] if len(sets) > KEEP_OTHER_INPUTS else []:
        shutil.rmtree(old, ignore_errors=True)
        say(f"grpo: removed {old}: checkpoints of other inputs beyond the {KEEP_OTHER_INPUTS} most recent sets kept")


def _save_weights(model, folder: Path) -> None:
    """The full model, or with LoRA only the trainable (adapter) weights: the frozen base is models/base."""
    from safetensors.torch import save_file, save_model

    if any(not p.requires_grad for p in model.parameters()):
        save_file({n: p.detach().contiguous() for n, p in model.named_parameters() if p.requires_grad},
                  str(folder / TRAINABLE_FILE))
    else:
        save_model(model, str(folder / "model.safetensors"))


def load_weights(path: Path, model) -> None:
    """Weights saved by `_save_weights` back into `model`, in place."""
    from safetensors.torch import load_file, load_model

    if (path / TRAINABLE_FILE).exists():
        saved = load_file(str(path / TRAINABLE_FILE))
        trainable = {n for n, p in model.named_parameters() if p.requires_grad}
        if set(saved) != trainable:
            raise CheckpointWriteError(f"{path / TRAINABLE_FILE} holds other trainable weights than this model "
                                       f"({len(saved)} saved, {len(trainable)} trainable): not resuming from it")
        model.load_state_dict(saved, strict=False)
    else:
        load_model(model, str(path / "model.safetensors"))


BEST = "best"  # checkpoints/grpo/best: the weights of the best held-out evaluation so far (grpo.keep: best)


def save_best(root: Path, step: int, run_hash: str, model, metric: str, value: float) -> Path:
    """Replace checkpoints/grpo/best atomically (a kill mid-write keeps the previous best)."""
    final, tmp = root / BEST, root / f".tmp-{BEST}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        _save_weights(model, tmp)
        (tmp / "meta.json").write_text(json.dumps({"step": step, "run_hash": run_hash, "metric": metric,
                                                   "value": value}) + "\n")
        old = root / f".old-{BEST}"
        shutil.rmtree(old, ignore_errors=True)
        if final.exists():
            final.rename(old)
        tmp.rename(final)
        shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


def best_meta(root: Path, run_hash: str) -> dict[str, Any] | None:
    """{step, metric, value} of this run's best weights, if saved (a `.old-best` left by a kill counts)."""
    for name in (BEST, f".old-{BEST}"):
        meta = root / name / "meta.json"
        if meta.exists():
            found = json.loads(meta.read_text())
            if found.get("run_hash") == run_hash:
                if name != BEST:
                    (root / name).rename(root / BEST)
                return found
    return None


def load_checkpoint(path: Path, model, optimizer, reference=None) -> dict[str, Any]:
    """Restore weights and optimizer in place; return the rest of the saved state."""
    from safetensors.torch import load_model

    load_weights(path, model)
    if reference is not None and (path / "reference.safetensors").exists():
        load_model(reference, str(path / "reference.safetensors"))
    import torch

    state = torch.load(path / "state.pt", weights_only=True)
    optimizer.load_state_dict(state.pop("optimizer"))
    return state
