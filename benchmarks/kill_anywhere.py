"""Kills at seeded random moments: does every rerun after a preemption end as an uninterrupted run?

Runs `grpo-pipeline run` with a short GRPO (one-off `--set` overrides, as a user would) once uninterrupted, for its
results and its wall time T. Then, per moment: a fresh copy of the repository, the same command, a SIGKILL of its
whole process tree (every process below it and every process working in the copy, frozen first so none sees the
others die: a preempted machine) after a delay drawn uniformly from [0, T] by a seeded generator, and the same command
again. Each rerun is compared with the uninterrupted run:

- its exit status 0, and `models/grpo` bit for bit, the prepared data's and the SFT model's hashes, params.yaml;
- `dvc status` clean, exactly one registered version (registration complete);
- nothing half-written in `checkpoints/` (no `.tmp-*`, no stage note left), none of DVC's lock warnings.

The results file lists where each kill landed (the stage, the GRPO step, seconds into the run, the last line the
run printed) and what the rerun said about it (its recovery lines). Results hold for the machine, thread count and
lock file recorded with them (bit-identical is promised for the same CPU kind and threads: README "What reproduced
means").

    python benchmarks/kill_anywhere.py                      # 40 moments (run it alone: kills at random times)
    python benchmarks/kill_anywhere.py --moments 3 --out /tmp/kills   # a quick look (results beside /tmp/kills)

Writes benchmarks/results/kill_anywhere.{json,md} (or OUT.json and OUT.md); exits 1 when any moment was not exact.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
BIN = Path(sys.executable).parent
RESULTS = ROOT / "benchmarks" / "results"
MODEL_NAME = "grpo-addition"

# A short run in which every stage does real work; GRPO checkpoints every 2 of its 8 steps, so kills land between
# checkpoints, on them and after the last one.
PARAMS = ["task.n_sft=300", "task.n_train=300", "task.n_heldout=120", "sft.epochs=4", "grpo.steps=8",
          "grpo.prompts_per_step=4", "grpo.group_size=4", "grpo.checkpoint_every=2", "grpo.log_every=2",
          "grpo.metrics_every=2", "evaluate.bootstrap_samples=500", "threads=1",
          "register.require_improvement=false"]
# What a rerun says about what a kill left (recovery lines, resumes) and what it must never print.
SAID = re.compile(r"^(dvc: |params\.yaml: |mlflow: a previous pipeline run|tracking: skipped|register: removed "
                  r"incomplete|tracking: \S+ had been left half-created)|previous run of this stage|resumed from|"
                  r"removed checkpoints/|skipped checkpoint|had been killed")
DVC_WARNING = "had been killed. Auto removed it from the lock file"


def fresh_copy(dest: Path) -> Path:
    """This working tree's tracked and untracked-but-not-ignored files, as a fresh git + DVC repository."""
    listed = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT, capture_output=True,
                            text=True, check=True).stdout.split("\0")
    for rel in filter(None, listed):
        src = ROOT / rel
        if src.is_file():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / rel)
    (dest / "data" / "user").mkdir(parents=True, exist_ok=True)
    for cmd in (["git", "init", "-q"], ["git", "config", "user.email", "kills@grpo-pipeline.local"],
                ["git", "config", "user.name", "kill_anywhere"], ["git", "add", "-A"],
                ["git", "commit", "-qm", "copy"]):
        subprocess.run(cmd, cwd=dest, check=True, capture_output=True)
    return dest


def run_env(repo: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PREFECT_API_URL", "GRPO_STAGE_SERVER")}
    env.update({"MLFLOW_TRACKING_URI": f"sqlite:///{repo / 'mlflow.db'}", "PREFECT_HOME": str(repo.parent / "prefect"),
                "MLFLOW_DISABLE_TELEMETRY": "true", "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
                "DVC_NO_ANALYTICS": "1", "GX_ANALYTICS_ENABLED": "false", "HF_HUB_OFFLINE": "1",
                "PYTHONUNBUFFERED": "1",  # each line arrives as printed: where a kill landed is read from them
                "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}"})
    return env


def command() -> list[str]:
    return [str(BIN / "grpo-pipeline"), "run", *[x for o in PARAMS for x in ("--set", o)]]


def outcome(repo: Path) -> dict[str, Any]:
    """What a finished run left: the hashes the rerun must match, the registry, DVC's status, checkpoints."""
    from mlflow.tracking import MlflowClient

    from components.data.paths import Paths
    from components.data.records import SPLITS, dir_md5, file_md5, split_path

    paths = Paths(root=repo)
    status = subprocess.run([str(BIN / "dvc"), "status"], cwd=repo, env=run_env(repo), capture_output=True,
                            text=True).stdout
    versions = MlflowClient(f"sqlite:///{repo / 'mlflow.db'}").search_model_versions(f"name = '{MODEL_NAME}'")
    checkpoints = repo / "checkpoints"
    half = sorted(str(p.relative_to(repo)) for p in checkpoints.rglob("*")
                  if p.name.startswith(".tmp-") or p.name.endswith(".running.json")) if checkpoints.exists() else []
    return {"grpo_md5": dir_md5(paths.grpo_model) if paths.grpo_model.exists() else None,
            "sft_md5": dir_md5(paths.sft_model) if paths.sft_model.exists() else None,
            "data_md5": {s: file_md5(split_path(paths.data, s)) for s in SPLITS if split_path(paths.data, s).exists()},
            "params_md5": file_md5(repo / "params.yaml"),
            "dvc_status_clean": status.strip().endswith("Data and pipelines are up to date."),
            "registered_versions": [(v.version, v.tags.get("registration")) for v in versions],
            "half_written": half}


def kill_tree(proc: subprocess.Popen, repo: Path) -> None:
    """SIGKILL everything the run started, at once: every process below it and every process working in `repo`
    (the stage server and the Prefect API run in sessions of their own), each frozen first so that none of them
    sees another die and reacts."""
    import psutil

    def victims() -> list[psutil.Process]:
        found = {}
        try:
            top = psutil.Process(proc.pid)
            found = {p.pid: p for p in [top, *top.children(recursive=True)]}
        except psutil.NoSuchProcess:
            pass
        for p in psutil.process_iter():
            try:
                if p.pid != os.getpid() and Path(p.cwd()).is_relative_to(repo):
                    found.setdefault(p.pid, p)
            except (psutil.Error, OSError):
                continue
        return list(found.values())

    for _ in range(3):  # a process forked while the others were being frozen is found the next round
        for p in victims():
            try:
                p.send_signal(signal.SIGSTOP)
            except psutil.Error:
                pass
    for p in victims():
        try:
            p.send_signal(signal.SIGKILL)
        except psutil.Error:
            pass
    proc.wait()
    deadline = time.time() + 30
    while victims() and time.time() < deadline:
        time.sleep(0.1)


def landed(lines: list[tuple[float, str]], at: float) -> dict[str, Any]:
    """Where the kill landed, from what the run had printed: its stage, its GRPO step, its last line."""
    stage, step, ended = "start-up (before the first stage)", None, False
    for _, line in lines:
        found = re.match(r"(?:Running stage|Stage) '(\w+)'", line)
        if found:
            stage, step = found.group(1), None
        steps = re.match(r"grpo: step (\d+)/(\d+)", line)
        if steps and stage == "grpo":
            step = f"{steps.group(1)} of {steps.group(2)}"
        if line.startswith("registered model:"):
            stage, ended = "the run's report (after the last stage)", True
    return {"seconds": round(at, 1), "stage": stage, "grpo_step": step, "after_register": ended,
            "last_line": lines[-1][1][:160] if lines else ""}


def one_moment(index: int, delay: float, work: Path, reference: dict[str, Any],
               rerun_server: str | None = None) -> dict[str, Any]:
    repo = fresh_copy(work / f"moment-{index:02d}" / "repo")
    env = run_env(repo)
    proc = subprocess.Popen(command(), cwd=repo, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    started, lines = time.monotonic(), []
    reader = threading.Thread(target=lambda: lines.extend((time.monotonic() - started, line.rstrip("\n"))
                                                          for line in proc.stdout), daemon=True)
    reader.start()
    while time.monotonic() - started < delay and proc.poll() is None:
        time.sleep(0.01)
    at = time.monotonic() - started
    finished = proc.poll() is not None
    if not finished:
        kill_tree(proc, repo)
    reader.join(timeout=10)
    where = landed(list(lines), at) if not finished else {"seconds": round(at, 1), "stage": "after the run ended",
                                                          "grpo_step": None, "after_register": True, "last_line": ""}
    t0 = time.monotonic()
    rerun_env = {**env, "GRPO_STAGE_SERVER": rerun_server} if rerun_server else env
    rerun = subprocess.run(command(), cwd=repo, env=rerun_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                           text=True, timeout=1800)
    result = outcome(repo)
    checks = {
        "rerun exit 0": rerun.returncode == 0,
        "models/grpo bit for bit": result["grpo_md5"] == reference["grpo_md5"],
        "SFT model hash": result["sft_md5"] == reference["sft_md5"],
        "data hashes": result["data_md5"] == reference["data_md5"],
        "params.yaml": result["params_md5"] == reference["params_md5"],
        "dvc status clean": result["dvc_status_clean"],
        "one registered version": len(result["registered_versions"]) == 1
        and result["registered_versions"][0][1] == "complete",
        "nothing half-written in checkpoints/": not result["half_written"],
        "no DVC lock warning": DVC_WARNING not in rerun.stdout,
    }
    shutil.rmtree(repo.parent, ignore_errors=True)
    return {"moment": index, "delay_s": round(delay, 2), "landed": where,
            "rerun": {"exit": rerun.returncode, "seconds": round(time.monotonic() - t0, 1),
                      "said": [line for line in rerun.stdout.splitlines() if SAID.search(line)],
                      "last_lines": rerun.stdout.strip().splitlines()[-15:] if rerun.returncode else []},
            "checks": checks, "failed": [name for name, ok in checks.items() if not ok],
            "exact": all(checks.values())}


def machine() -> dict[str, Any]:
    cpu = platform.processor()
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                   if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return {"cpu": cpu, "cores": os.cpu_count(), "python": platform.python_version()}


def commit() -> str:
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout
    dirty = subprocess.run(["git", "status", "--porcelain"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    return head.strip() + ("-dirty" if dirty else "")


def kill_anywhere(moments: int, seed: int, work: Path, log=print, rerun_server: str | None = None) -> dict[str, Any]:
    """The uninterrupted run, then `moments` kills at seeded uniform moments of its wall time, each rerun compared.

    `rerun_server`: a warm stage server (GRPO_STAGE_SERVER) the reruns hand their stages to, as the test suite's
    runs do; the uninterrupted run and every killed run start their own, as a user's run does, so the moments are
    drawn from a user's run time and each kill takes the run's stage server with it."""
    repo = fresh_copy(work / "reference" / "repo")
    t0 = time.monotonic()
    straight = subprocess.run(command(), cwd=repo, env=run_env(repo), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True, timeout=1800)
    wall = time.monotonic() - t0
    if straight.returncode != 0:
        raise RuntimeError(f"the uninterrupted run failed:\n{straight.stdout[-3000:]}")
    reference = outcome(repo)
    log(f"uninterrupted run: {wall:.1f} s; models/grpo {reference['grpo_md5']}")
    shutil.rmtree(repo.parent, ignore_errors=True)
    draw = random.Random(seed)
    delays = [draw.uniform(0.0, wall) for _ in range(moments)]
    rows = []
    for i, delay in enumerate(delays):
        row = one_moment(i, delay, work, reference, rerun_server)
        rows.append(row)
        where = row["landed"]
        log(f"moment {i + 1}/{moments}: killed at {where['seconds']:.1f} s in {where['stage']}"
            f"{' step ' + where['grpo_step'] if where['grpo_step'] else ''}: "
            f"{'exact' if row['exact'] else 'NOT EXACT: ' + ', '.join(row['failed'])}")
    by_stage: dict[str, int] = {}
    for row in rows:
        by_stage[row["landed"]["stage"]] = by_stage.get(row["landed"]["stage"], 0) + 1
    return {"command": f"python benchmarks/kill_anywhere.py --moments {moments} --seed {seed}",
            "run": " ".join(["grpo-pipeline run", *[f"--set {o}" for o in PARAMS]]), "seed": seed,
            "machine": machine(), "commit": commit(), "finished": time.strftime("%Y-%m-%d %H:%M"),
            "uninterrupted_seconds": round(wall, 1), "reference": reference, "moments": rows,
            "summary": {"moments": len(rows), "exact": sum(r["exact"] for r in rows), "by_stage": by_stage}}


def markdown(result: dict[str, Any]) -> str:
    s = result["summary"]
    lines = ["# Kills at seeded random moments, and the rerun\n",
             f"`{result['command']}` at {result['commit']} on {result['machine']['cpu']} ({result['machine']['cores']} "
             f"cores), {result['finished']}. The run: `{result['run']}`, {result['uninterrupted_seconds']} s "
             "uninterrupted; each kill a SIGKILL of its whole process tree after a delay drawn uniformly from that "
             "time, then the same command again.\n",
             f"**{s['exact']} of {s['moments']} reruns exact** (exit 0, models/grpo bit for bit, data and SFT hashes, "
             "params.yaml, `dvc status` clean, one registered version, nothing half-written in checkpoints/, no DVC "
             "lock warning).\n",
             "| moment | killed at | stage | GRPO step | the rerun said | exact |", "|---|---|---|---|---|---|"]
    for row in result["moments"]:
        where = row["landed"]
        said = "; ".join(row["rerun"]["said"]).replace("|", "\\|") or "nothing of the kill"
        exact = "yes" if row["exact"] else "NO: " + ", ".join(row["failed"])
        lines.append(f"| {row['moment'] + 1} | {where['seconds']} s | {where['stage']} | {where['grpo_step'] or ''} | "
                     f"{said} | {exact} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--moments", type=int, default=40)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=str(RESULTS / "kill_anywhere"), help="results path without .json/.md")
    parser.add_argument("--work", default=None, help="scratch folder (default: a new temp folder, removed after)")
    args = parser.parse_args(argv)
    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="kill-anywhere-"))
    try:
        result = kill_anywhere(args.moments, args.seed, work)
    finally:
        if not args.work:
            shutil.rmtree(work, ignore_errors=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
    out.with_suffix(".md").write_text(markdown(result))
    print(markdown(result))
    return 0 if result["summary"]["exact"] == result["summary"]["moments"] else 1


if __name__ == "__main__":
    sys.exit(main())
