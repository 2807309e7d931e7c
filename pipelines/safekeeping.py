"""A failed or interrupted run leaves the working copy as it found it.

DVC deletes a stage's outputs before it reruns the stage, and `run --set` writes params.yaml first
(so that `dvc repro` reproduces the run). If the run then fails, the user would be left with the new
params, a rewritten dvc.lock and half of a new run's outputs. So, before a run, this keeps copies of
params.yaml, dvc.lock and the uncached outputs (metrics, plots: small files), and records which
outputs existed; on failure it puts them back, and restores the cached outputs (data/prepared,
models/...) from the DVC cache as the restored dvc.lock names them (`dvc checkout`). The overrides of a
failed run are therefore not applied; after a run that succeeds they stay in params.yaml until the next
run without overrides puts the user's own settings back (`--persist` keeps them: pipelines/params_io.py).

Kept as the failed run left them: GRPO's checkpoints (not DVC outputs; keyed to their inputs, so a rerun of
the same command resumes from them and nothing else ever does) and the run's log in logs/, where the failed
run's own reports (e.g. metrics/validation.json) are copied for reading.

A failure that says nothing against the stages that finished (registering could not reach the tracking server;
DVC could not store an output in its cache) keeps what they produced instead (`restore(finished=...)`): their
outputs, dvc.lock and the run's params, as `dvc repro` leaves them after a later stage failed, so the rerun of
the same command runs only what did not finish. Any other failure: a rerun of the same command gets the
finished stages back from DVC's run cache, not by running them again.

Chosen over `dvc exp run`: experiments apply params in a temporary commit and are restored with
`dvc exp apply`, but they need a clean git tree and do not undo dvc.lock or outputs of a run that failed.
"""

from __future__ import annotations

import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from components.config.loading import safe_load

KEPT_FILES = ("params.yaml", "dvc.lock", ".params.base.yaml", ".params.run.json")


@dataclass
class Output:
    path: str
    cached: bool
    persist: bool
    stage: str = ""


def dvc_outputs(root: Path) -> list[Output]:
    """Every out, metric and plot path of dvc.yaml with its cache and persist flags and its stage."""
    stages = (safe_load((root / "dvc.yaml").read_text()) or {}).get("stages", {})
    found = []
    for name, stage in stages.items():
        for section in ("outs", "metrics", "plots"):
            for entry in stage.get(section, []) or []:
                path, flags = (entry, {}) if isinstance(entry, str) else next(iter(entry.items()))
                flags = flags or {}
                found.append(Output(path, bool(flags.get("cache", True)), bool(flags.get("persist", False)), name))
    return found


@dataclass
class WorkingCopySnapshot:
    """What a run may change, taken before it starts; `restore()` after a failure, `discard()` after success."""

    root: Path
    backup: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="grpo-safekeeping-")))
    existed: dict[str, bool] = field(default_factory=dict)

    @classmethod
    def take(cls, root: Path) -> WorkingCopySnapshot:
        snapshot = cls(root)
        for name in KEPT_FILES:
            snapshot._keep(name)
        for out in dvc_outputs(root):
            snapshot.existed[out.path] = (root / out.path).exists()
            if not out.cached and not out.persist:
                snapshot._keep(out.path)
        return snapshot

    def _keep(self, rel: str) -> None:
        source = self.root / rel
        self.existed[rel] = source.exists()
        if source.is_dir():
            shutil.copytree(source, self.backup / rel)
        elif source.exists():
            (self.backup / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, self.backup / rel)

    def _put_back(self, rel: str) -> None:
        """A file in one rename (a kill while putting it back leaves the run's or the kept one, never neither: e.g.
        params.yaml); a folder (metrics/, plots/: outputs DVC checks) removed, then copied."""
        target, kept = self.root / rel, self.backup / rel
        if kept.is_file():
            target.parent.mkdir(parents=True, exist_ok=True)
            tmp = target.with_name(target.name + ".restoring")
            shutil.copy2(kept, tmp)
            if target.is_dir():
                shutil.rmtree(target)
            tmp.replace(target)
            return
        if target.is_dir():
            shutil.rmtree(target)
        elif target.exists():
            target.unlink()
        if kept.is_dir():
            shutil.copytree(kept, target)

    def keep_reports(self, log_dir: Path) -> list[Path]:
        """Copy the failed run's reports (metrics/*.json it wrote) beside its log before they are undone."""
        copied = []
        for report in sorted((self.root / "metrics").glob("*.json")):
            kept = self.backup / "metrics" / report.name
            if not kept.exists() or kept.read_bytes() != report.read_bytes():
                log_dir.mkdir(parents=True, exist_ok=True)
                shutil.copy2(report, log_dir / report.name)
                copied.append(log_dir / report.name)
        return copied

    def restore(self, finished: frozenset[str] | set[str] = frozenset()) -> None:
        """params.yaml, dvc.lock and every non-persistent output as they were before the run; with `finished`
        stages, what those produced stays (their outputs, dvc.lock, the run's params), as `dvc repro` leaves it
        after a later stage failed, and only the other stages' outputs are put back."""
        if not finished:
            for name in KEPT_FILES:
                self._put_back(name)
        restore_from_cache = []
        for out in dvc_outputs(self.root):
            if out.persist or out.stage in finished:
                continue
            if not out.cached:
                self._put_back(out.path)
            elif self.existed.get(out.path):
                restore_from_cache.append(out.path)
            else:  # a new output of the failed run: it did not exist before
                self._put_back(out.path)
        if restore_from_cache and (self.root / "dvc.lock").exists():
            from dvc.repo import Repo

            with Repo(str(self.root)) as repo:
                repo.checkout(targets=restore_from_cache, force=True, allow_missing=True)

    def discard(self) -> None:
        shutil.rmtree(self.backup, ignore_errors=True)
