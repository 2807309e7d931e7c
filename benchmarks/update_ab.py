"""The update alone, this checkout against another, on the same rollouts: policy forward, backward and optimizer step
(`policy_updates`) timed over fixed rollout sets, the two checkouts taking turns.

    python benchmarks/update_ab.py --against ../base --rows smollm2-long,calculator --rounds 7

A run's trajectories diverge between two checkouts as soon as their rounding differs (another sampled token, another
length), so a whole-run comparison (benchmarks/before_after.py) times different work each round. Here each side, in its
own process running its checkout's code, builds the row's policy through the pipeline's door (`build_policy`, from the
row's SFT warm start, which benchmarks/grpo_vs_trl.py builds once), samples `--sets` rollout sets from the row's
training prompts with one seed (the sampler is the same code on both sides, so the rollouts are the same: the report
says whether their tokens agree), draws random advantages, and then, each round, runs the update on every set. Rounds
alternate (now, before; before, now; ...; the first warms both up). Reports per row the median of the per-round ratios
of update seconds (now / before) with their range, each side's median seconds, completion tokens per set and peak
resident memory during the updates. Writes benchmarks/results/update_ab.{json,md} (`--name`: another name, `--update`:
only the rows measured); the figures belong in HISTORY.md, not in user pages.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, os.environ.get("UPDATE_AB_TREE", str(ROOT)))  # a worker imports its own checkout's code

SIDES = ("now", "before")


def worker(spec: dict[str, Any]) -> None:
    """One side: build the policy, sample the sets, then time the update on every set when told to."""
    import torch

    from benchmarks.grpo_vs_trl import Channel, peak_rss_mb, reset_peak_rss, worker_config
    from components.data.records import read_jsonl, split_path
    from components.engine.grpo.batch import sampling_params
    from components.engine.grpo.objectives import build_loss
    from components.engine.grpo.policy import build_policy
    from components.engine.grpo.trajectory import Trajectory
    from components.engine.grpo.update import UpdatePlan, policy_updates, reference_logprobs
    from components.engine.models.modeling import seed_everything
    from components.engine.models.optim import make_optimizer

    channel = Channel(spec["fd_in"], spec["fd_out"])
    cfg = worker_config({**spec, "steps": 1})
    g, root = cfg.grpo, Path(spec["root"])
    seed_everything(cfg.seed, cfg.threads)
    per_set = g.prompts_per_step
    records = read_jsonl(split_path(root / "data" / "prepared", "train"))[: per_set * spec["sets"]]
    loss = build_loss(g)
    policy, _ = build_policy(cfg, root / "models" / "sft", torch.device("cpu"), records, loss.uses_reference,
                             say=lambda *a, **k: None)
    optimizer = make_optimizer(policy.model, g.learning_rate, g.weight_decay, torch.device("cpu"))
    generator = torch.Generator().manual_seed(cfg.seed)
    digest, sets, tokens = hashlib.sha256(), [], []
    for k in range(spec["sets"]):
        rollouts = policy.sample(records[k * per_set:(k + 1) * per_set], sampling_params(g), generator)
        plan = UpdatePlan.of(len(rollouts), rollouts.group_size, g)
        ref = reference_logprobs(policy, rollouts, plan) if loss.uses_reference else None
        advantages = torch.randn(len(rollouts), generator=generator)
        scorable = torch.ones(len(rollouts), dtype=torch.bool)
        sets.append((Trajectory(rollouts, advantages, rollouts.written.float(), scorable, ref), plan))
        digest.update(rollouts.completion_ids.numpy().tobytes())
        tokens.append(int(rollouts.written.sum()))
    channel.send({"event": "ready", "digest": digest.hexdigest()[:16], "tokens": tokens})
    while channel.receive() == "round":
        reset_peak_rss()
        seconds = []
        for trajectory, plan in sets:
            started = time.perf_counter()
            policy_updates(policy, optimizer, trajectory, g, loss, plan)
            seconds.append(time.perf_counter() - started)
        channel.send({"event": "round", "seconds": seconds, "peak_rss_mb": peak_rss_mb()})


class Side:
    """A worker process over `tree`'s code, driven over two pipes."""

    def __init__(self, tree: Path, spec: dict[str, Any], log: Path):
        cmd_r, self._cmd_w = os.pipe()
        self._rep_r, rep_w = os.pipe()
        python = tree / ".venv" / "bin" / "python" if (tree / ".venv").exists() else Path(sys.executable)
        env = dict(os.environ, PYTHONPATH=str(tree), UPDATE_AB_TREE=str(tree))
        self.log = log.open("w")
        self.proc = subprocess.Popen(
            [str(python), str(Path(__file__).resolve()), "--worker", json.dumps({**spec, "fd_in": cmd_r,
                                                                                  "fd_out": rep_w})],
            stdout=self.log, stderr=subprocess.STDOUT, env=env, pass_fds=(cmd_r, rep_w), cwd=str(tree))
        os.close(cmd_r)
        os.close(rep_w)
        self.commands, self.reports = os.fdopen(self._cmd_w, "w"), os.fdopen(self._rep_r, "r")
        self.log_path = log

    def ask(self, command: str | None, event: str) -> dict[str, Any]:
        if command is not None:
            self.commands.write(command + "\n")
            self.commands.flush()
        line = self.reports.readline()
        if not line:
            raise RuntimeError(f"worker exited ({self.proc.wait()}); see {self.log_path}")
        message = json.loads(line)
        if message.get("event") != event:
            raise RuntimeError(f"expected {event}, got {message}")
        return message

    def close(self) -> None:
        self.commands.write("stop\n")
        self.commands.flush()
        self.proc.wait(timeout=120)


def compare(row_name: str, against: Path, args, work: Path) -> dict[str, Any]:
    from benchmarks.grpo_vs_trl import ROWS, prepare_start

    row = ROWS[row_name]
    root = prepare_start(row, work, args.threads)
    spec = {"row": row.name, "root": str(root), "threads": args.threads, "seed": args.seed, "sets": args.sets}
    trees = {"now": ROOT, "before": against}
    sides = {side: Side(trees[side], spec, work / f"update-ab-{row.name}-{side}.log") for side in SIDES}
    ready = {side: sides[side].ask(None, "ready") for side in SIDES}
    seconds: dict[str, list[float]] = {side: [] for side in SIDES}
    peak = {side: 0.0 for side in SIDES}
    started = time.perf_counter()
    for r in range(args.rounds):
        for side in SIDES if r % 2 == 0 else tuple(reversed(SIDES)):
            report = sides[side].ask("round", "round")
            if r > 0:  # the first round warms both up
                seconds[side].append(sum(report["seconds"]) / len(report["seconds"]))
                peak[side] = max(peak[side], report["peak_rss_mb"])
        elapsed = time.perf_counter() - started
        print(f"[{row.name}] round {r + 1}/{args.rounds} ({elapsed / 60:.1f} min, ETA "
              f"{elapsed / (r + 1) * (args.rounds - r - 1) / 60:.1f} min)", flush=True)
    for side in sides.values():
        side.close()
    ratios = [a / b for a, b in zip(seconds["now"], seconds["before"])]
    return {"row": row.name, "rounds": args.rounds, "sets": args.sets,
            "same_rollouts": ready["now"]["digest"] == ready["before"]["digest"],
            "completion_tokens_per_set": ready["now"]["tokens"],
            "update_seconds_ratio_now_over_before": round(statistics.median(ratios), 3),
            "per_round_ratios": [round(x, 3) for x in ratios],
            "update_seconds": {side: round(statistics.median(seconds[side]), 3) for side in SIDES},
            "peak_rss_mb": {side: round(peak[side], 1) for side in SIDES}}


def markdown(report: dict[str, Any]) -> str:
    lines = [f"# The update on the same rollouts: this checkout against {report['against_commit']}", "",
             f"Machine: {report['machine']}. Each row: its commit and its command. Update seconds: the mean over the "
             "row's rollout sets of one `policy_updates` call (policy forward, backward, optimizer step).", "",
             "| row | update s now / before (median of rounds) | per-round range | update s now, before "
             "| same rollouts | completion tokens per set | peak RSS now, before (MB) | commit, command |",
             "|---|---|---|---|---|---|---|---|"]
    for r in report["rows"]:
        u, m = r["update_seconds"], r["peak_rss_mb"]
        lines.append(f"| {r['row']} | **{r['update_seconds_ratio_now_over_before']:.3f}** | "
                     f"{min(r['per_round_ratios']):.3f} .. {max(r['per_round_ratios']):.3f} | {u['now']:.3f}, "
                     f"{u['before']:.3f} | {'yes' if r['same_rollouts'] else 'NO'} | "
                     f"{', '.join(map(str, r['completion_tokens_per_set']))} | {m['now']:.0f}, {m['before']:.0f} | "
                     f"{r.get('commit', report['commit'])}, `{r.get('command', report['command'])}` |")
    return "\n".join(lines) + "\n"


def main() -> int:
    from benchmarks.before_after import comparison_report, write_report

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--against", required=True, help="the other checkout (with its own .venv, or this one's)")
    parser.add_argument("--rows", default="tiny,smollm2-long,calculator")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--sets", type=int, default=3, help="rollout sets (steps' worth of rows) timed each round")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--work", default=str(ROOT / "benchmarks" / ".work"))
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    parser.add_argument("--name", default="update_ab", help="the results files' name")
    parser.add_argument("--update", action="store_true", help="replace only the rows measured")
    args = parser.parse_args()
    against, work = Path(args.against).resolve(), Path(args.work)
    report = comparison_report(against, work, "update_ab.py")
    out = Path(args.out)
    json_path, md_path = out / f"{args.name}.json", out / f"{args.name}.md"
    earlier = json.loads(json_path.read_text()) if args.update and json_path.exists() else None
    for name in [r.strip() for r in args.rows.split(",") if r.strip()]:
        report["rows"].append({**compare(name, against, args, work), "commit": report["commit"],
                               "command": report["command"]})
    same_pair = earlier is not None and earlier["against_commit"] == report["against_commit"]
    write_report(report, earlier if same_pair else None, json_path, md_path, markdown)
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--worker":
        worker(json.loads(sys.argv[2]))
        sys.exit(0)
    sys.exit(main())
