"""`grpo-pipeline reproduce`: re-run a registered version from its recorded inputs and compare.

The version's tags name its git commit, dataset hashes and model hash; its run holds the exact
params.yaml. The commit is checked out into a temporary git worktree sharing this repo's DVC cache,
params.yaml is restored, `dvc repro --force evaluate` re-runs every stage against a scratch MLflow
store (the real registry is never touched), and weights, data and held-out reward are compared:
exactly on CPU; on a GPU the weight difference and reward difference are reported against a tolerance.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from components.data.paths import Paths
from components.data.records import SPLITS, dir_md5, file_md5, split_path
from components.tracking.registry import current_tags
from components.tracking.runs import PARENT_RUN_ENV

REWARD_TOLERANCE_GPU = 0.02


@dataclass
class Comparison:
    """One recorded-versus-reproduced check."""

    what: str
    recorded: str
    reproduced: str
    match: bool


@dataclass
class ReproduceReport:
    """Recorded-versus-reproduced checks, judged by what the environment allows.

    Same CPU kind, kernel path, threads, torch and lock file: the weights and metrics must be
    bit-identical. Anything of those different: other kernels round differently, so only the data
    must be identical and the held-out reward must lie in the band measured for the default
    (benchmarks/results/seed_spread.json); for other params no band is known and nothing is claimed.
    """

    model: str
    commit: str
    checks: list[Comparison] = field(default_factory=list)
    environment_differences: list[str] = field(default_factory=list)
    band: tuple[float, float] | None = None
    reward: float | None = None

    @property
    def exact_expected(self) -> bool:
        return not self.environment_differences

    @property
    def within_band(self) -> bool:
        return self.band is not None and self.reward is not None and self.band[0] <= self.reward <= self.band[1]

    @property
    def match(self) -> bool:
        if not self.checks:
            return False
        if self.exact_expected:
            return all(c.match for c in self.checks)
        return all(c.match for c in self.checks if "data" in c.what) and self.within_band

    def table(self) -> str:
        width = max(len(c.what) for c in self.checks)
        lines = [f"reproduce {self.model} at commit {self.commit}"]
        for c in self.checks:
            lines.append(f"  {'OK ' if c.match else 'DIFF'} {c.what:<{width}}  recorded {c.recorded}  "
                         f"reproduced {c.reproduced}")
        if self.exact_expected:
            lines.append("same CPU kind, kernel path, threads, torch and lock file: bit-identical results expected")
            lines.append("MATCH: weights and held-out metrics reproduced bit for bit" if self.match else
                         "MISMATCH: the environment is the same, so the bits should be; see the DIFF lines")
            return "\n".join(lines)
        lines.append("another environment, so not bit-identical by design (other kernels round differently): "
                     + "; ".join(self.environment_differences))
        if self.band is None:
            lines.append("NOT VERIFIED: no band was measured for these params (benchmarks/seed_spread.py measures the "
                         "default's); compare the held-out reward above yourself")
        elif self.match:
            lines.append(f"REPRODUCED WITHIN THE BAND: held-out reward {self.reward:.3f} lies in the default's "
                         f"measured band {self.band[0]:.3f} .. {self.band[1]:.3f}; data identical")
        else:
            lines.append(f"OUTSIDE THE BAND: held-out reward {self.reward:.3f}, the default's measured band is "
                         f"{self.band[0]:.3f} .. {self.band[1]:.3f} (or the data differ)")
        return "\n".join(lines)


def _run(cmd: list[str], cwd: Path, env: dict[str, str] | None = None) -> str:
    proc = subprocess.run(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed in {cwd}:\n{proc.stdout[-3000:]}")
    return proc.stdout


def resolve_version(client, name: str, version: str | None, run_id: str | None):
    """The registered version to reproduce, by number or by the run that registered it."""
    if version is not None:
        return client.get_model_version(name, version)
    # A full run id, or the short prefix the tool prints
    matches = [v for v in client.search_model_versions(f"name = '{name}'") if v.run_id and v.run_id.startswith(run_id)]
    if not matches:
        raise ValueError(f"no version of {name} was registered by run {run_id}")
    if len({v.run_id for v in matches}) > 1:
        raise ValueError(f"run id prefix {run_id!r} matches {len(matches)} versions of {name}; give more characters")
    return matches[0]


def reproduce(root: Path, name: str, version: str | None = None, run_id: str | None = None,
              keep: bool = False) -> ReproduceReport:
    from components.tracking.runs import client as mlflow_client

    client = mlflow_client()
    mv = resolve_version(client, name, version, run_id)
    tags = current_tags(mv.tags)
    commit = tags.get("lineage.git_commit", "unknown").removesuffix("-dirty")
    if commit == "unknown":
        raise ValueError(f"{name} v{mv.version} has no lineage.git_commit tag; it cannot be reproduced")
    report = ReproduceReport(model=f"models:/{name}/{mv.version}", commit=commit)
    work = Path(tempfile.mkdtemp(prefix="grpo-reproduce-"))
    tree = work / "tree"
    _run(["git", "worktree", "add", "--detach", str(tree), commit], root)
    try:
        shutil.copy(client.download_artifacts(mv.run_id, "lineage/params.yaml", str(work)), tree / "params.yaml")
        user_data = root / "data" / "user"
        if user_data.exists():  # datasets the user keeps there (DVC-tracked files come from the shared cache)
            shutil.copytree(user_data, tree / "data" / "user", dirs_exist_ok=True)
        env = {k: v for k, v in os.environ.items() if k != PARENT_RUN_ENV}
        env["MLFLOW_TRACKING_URI"] = f"sqlite:///{work / 'scratch-mlflow.db'}"
        env["PATH"] = str(Path(sys.executable).parent) + os.pathsep + env.get("PATH", "")
        dvc = [sys.executable, "-m", "dvc"]
        _run(dvc + ["cache", "dir", "--local", str((root / ".dvc" / "cache").resolve())], tree, env)
        print(f"reproduce: re-running {report.model} from commit {commit} in {tree}", flush=True)
        with warm_stage_server(tree, env):
            _run(dvc + ["repro", "--force", "evaluate"], tree, env)
        compare(report, tags, Paths(root=tree))
        judge_environment(report, tags, tree)
    finally:
        if not keep:
            subprocess.run(["git", "worktree", "remove", "--force", str(tree)], cwd=root, capture_output=True)
            shutil.rmtree(work, ignore_errors=True)
    return report


def judge_environment(report: ReproduceReport, tags: dict[str, str], tree: Path) -> None:
    """Which promise applies (bit-identical, or within the measured band) and the band itself."""
    from components.config import default_fingerprint, load_config
    from components.engine.models.modeling import pick_device
    from components.tracking.run_environment import differences, run_environment

    cfg = load_config(tree / "params.yaml")
    current = run_environment(cfg.threads, str(pick_device(cfg.device)))
    lock = tree / "requirements.lock"
    current["lineage.lock_md5"] = file_md5(lock) if lock.exists() else "none"
    report.environment_differences = differences(tags, current)
    report.reward = json.loads((tree / "metrics" / "eval.json").read_text())["candidate"]["mean_reward"]
    spread = tree / "benchmarks" / "results" / "seed_spread.json"
    if spread.exists():
        measured = json.loads(spread.read_text())
        if measured.get("default_fingerprint") == default_fingerprint(cfg):
            after = measured["summary"]["all"]["after_grpo"]
            report.band = (after["min"], after["max"])


# Where a commit keeps its stage server: today's layout first, then the one before components/ was split by role.
SERVER_LAYOUTS = {"components/runtime/stage_server.py": "components.runtime.stage_server",
                  "components/stage_server.py": "components.stage_server"}


def stage_server_module(tree: Path) -> str | None:
    """The module that starts `tree`'s own stage server, or None for commits from before it existed."""
    return next((name for rel, name in SERVER_LAYOUTS.items() if (tree / rel).exists()), None)


@contextlib.contextmanager
def warm_stage_server(tree: Path, env: dict[str, str]) -> Iterator[None]:
    """The recorded commit's own stage server for the re-run, when that commit has one (the stages then
    skip their imports, as in a pipeline run); older commits simply run their stages as DVC starts them.
    Commits from before components/ was split by role keep their server at components/stage_server.py."""
    module = stage_server_module(tree)
    if module is None:
        yield
        return
    from components.runtime.stage_server import SERVER_ENV, start_server, stop_server

    server = start_server(str(tree), module)  # `python -m <module>` in the tree: its code, not ours
    env[SERVER_ENV] = server[1]
    try:
        yield
    finally:
        env.pop(SERVER_ENV, None)
        stop_server(*server)


def compare(report: ReproduceReport, tags: dict[str, str], paths: Paths) -> None:
    """Fill `report` with data, weight and metric comparisons against the version's tags."""
    import torch

    on_gpu = torch.cuda.is_available()
    for split in SPLITS:
        key = f"data.{split}.md5"
        if key in tags:
            ours = file_md5(split_path(paths.data, split))
            report.checks.append(Comparison(f"{split} data md5", tags[key], ours, ours == tags[key]))
    weights = dir_md5(paths.grpo_model)
    report.checks.append(Comparison("model weights md5", tags.get("lineage.candidate_md5", "?"), weights,
                                    weights == tags.get("lineage.candidate_md5") or on_gpu))
    evaluation = json.loads((paths.metrics / "eval.json").read_text())
    recorded = float(tags.get("eval.heldout_mean_reward", "nan"))
    ours = evaluation["candidate"]["mean_reward"]
    tolerance = REWARD_TOLERANCE_GPU if on_gpu else 5e-7
    report.checks.append(Comparison(f"held-out mean reward (tolerance {tolerance:g})", f"{recorded:.6f}",
                                    f"{ours:.6f}", abs(ours - recorded) <= tolerance))
