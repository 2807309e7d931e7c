"""Is this checkout's engine slower than another checkout's? The same grpo_vs_trl row trained by both, alternating.

    python benchmarks/before_after.py --against ../base --rows tiny,smollm2-lora,smollm2-full,smollm2-long

Both engines train the row's GRPO settings from the same start (built once, as benchmarks/grpo_vs_trl.py builds it)
in their own processes, taking turns in short rounds (now, before; before, now; ...; the first round warms both up),
so a machine that drifts slows both alike. `--against` is a checkout with its own `.venv` (for instance a git
worktree of an earlier commit, `make setup` in it). Reports per row the median of the per-round completions/s ratios
(now / before) with their range, each engine's peak resident memory, and whether both ended with the same held-out
reward (a refactor that keeps the maths should: the same seed, the same steps), and the update's own seconds a step
(time/policy) and whole steps' completion tokens/s, each as a median of per-round ratios with their range. Writes
benchmarks/results/before_after.{json,md} (`--name`: another name)
(`--update`: only the rows measured, each row with its commit and command);
the figures belong in HISTORY.md, not in user pages.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.grpo_vs_trl import ROWS, Worker, prepare_start  # noqa: E402

SIDES = ("now", "before")


def linked_start(root: Path, other: Path) -> Path:
    """A second root whose start (SFT model, base model, data) is the first's, by symlinks: each side's run
    folder and MLflow store stay apart."""
    for rel in ("models/sft", "models/base", "data/prepared"):
        link = other / rel
        link.parent.mkdir(parents=True, exist_ok=True)
        if not link.is_symlink():
            link.symlink_to((root / rel).resolve())
    return other


def compare(row_name: str, against: Path, args, work: Path) -> dict[str, Any]:
    row = ROWS[row_name]
    root = prepare_start(row, work, args.threads)
    rounds, round_steps = args.rounds or row.rounds, args.round_steps or row.round_steps
    spec = {"row": row.name, "steps": rounds * round_steps, "round_steps": round_steps, "threads": args.threads,
            "seed": args.seed, "heldout": args.heldout}
    roots = {"now": root, "before": linked_start(root, work / f"{row.setup}-before")}
    trees = {"now": ROOT, "before": against}
    workers: dict[str, Worker] = {}
    rates: dict[str, list[float]] = {side: [] for side in SIDES}
    tokens: dict[str, list[float]] = {side: [] for side in SIDES}  # completion tokens/s of whole steps
    update: dict[str, list[float]] = {side: [] for side in SIDES}  # the update's seconds a step (time/policy)
    peak = {side: 0.0 for side in SIDES}
    heldout: dict[str, float] = {}
    started = time.perf_counter()
    for r in range(rounds):
        for side in SIDES if r % 2 == 0 else tuple(reversed(SIDES)):
            if side not in workers:
                workers[side] = Worker("ours", {**spec, "root": str(roots[side])}, work / f"{row.name}-{side}.log",
                                       trees[side])
            else:
                workers[side].command("go")
            report = workers[side].expect("round")
            if r > 0:
                steps, seconds = report["steps"], sum(s["seconds"] for s in report["steps"])
                rates[side].append(sum(s["completions"] for s in steps) / seconds)
                tokens[side].append(sum(s["tokens"] for s in steps) / seconds)
                update[side].append(sum(s["policy"] for s in steps) / len(steps))
            peak[side] = max(peak[side], report["peak_rss_mb"])
            if r == rounds - 1:
                workers[side].command("eval")
                heldout[side] = workers[side].expect("eval")["mean"]
        if r:
            elapsed = time.perf_counter() - started
            print(f"[{row.name}] round {r + 1}/{rounds}: now {rates['now'][-1]:.1f}, before {rates['before'][-1]:.1f} "
                  f"completions/s ({elapsed / 60:.1f} min, ETA {elapsed / (r + 1) * (rounds - r - 1) / 60:.1f} min)",
                  flush=True)
    for w in workers.values():
        w.command("go")
        w.expect("finished")
        w.proc.wait(timeout=120)
    ratios = [a / b for a, b in zip(rates["now"], rates["before"])]
    token_ratios = [a / b for a, b in zip(tokens["now"], tokens["before"])]
    update_ratios = [a / b for a, b in zip(update["now"], update["before"])]
    return {"row": row.name, "rounds": rounds, "round_steps": round_steps,
            "ratio_now_over_before": round(statistics.median(ratios), 3),
            "per_round_ratios": [round(x, 3) for x in ratios],
            "tokens_per_s_ratio_now_over_before": round(statistics.median(token_ratios), 3),
            "per_round_tokens_per_s_ratios": [round(x, 3) for x in token_ratios],
            "update_seconds_ratio_now_over_before": round(statistics.median(update_ratios), 3),
            "per_round_update_seconds_ratios": [round(x, 3) for x in update_ratios],
            "update_seconds": {side: round(statistics.median(update[side]), 3) for side in SIDES},
            "completions_per_s": {side: round(statistics.median(rates[side]), 2) for side in SIDES},
            "peak_rss_mb": {side: round(peak[side], 1) for side in SIDES},
            "heldout_reward": {side: round(heldout[side], 4) for side in SIDES}}


def markdown(report: dict[str, Any]) -> str:
    lines = [f"# This checkout against {report['against_commit']}, alternating rounds", "",
             f"Machine: {report['machine']}. Each row: its commit and its command.", "",
             "| row | now / before (median of rounds) | per-round range | completions/s now, before | "
             "peak RSS now, before (MB) | held-out now, before | commit, command |", "|---|---|---|---|---|---|---|"]
    for r in report["rows"]:
        c, m, h = r["completions_per_s"], r["peak_rss_mb"], r["heldout_reward"]
        lines.append(f"| {r['row']} | **{r['ratio_now_over_before']:.3f}** | {min(r['per_round_ratios']):.3f} .. "
                     f"{max(r['per_round_ratios']):.3f} | {c['now']:.1f}, {c['before']:.1f} | {m['now']:.0f}, "
                     f"{m['before']:.0f} | {h['now']:.3f}, {h['before']:.3f} | "
                     f"{r.get('commit', report['commit'])}, `{r.get('command', report['command'])}` |")
    timed = [r for r in report["rows"] if "update_seconds" in r]
    if timed:  # the update alone (time/policy: policy forward, backward, optimizer) and whole steps' tokens/s
        lines += ["", "| row | update s/step now / before (median of rounds) | per-round range | update s/step now, "
                  "before | completion tokens/s now / before (median) | per-round range |", "|---|---|---|---|---|---|"]
        for r in timed:
            u, t = r["per_round_update_seconds_ratios"], r["per_round_tokens_per_s_ratios"]
            lines.append(f"| {r['row']} | **{r['update_seconds_ratio_now_over_before']:.3f}** | {min(u):.3f} .. "
                         f"{max(u):.3f} | {r['update_seconds']['now']:.3f}, {r['update_seconds']['before']:.3f} | "
                         f"**{r['tokens_per_s_ratio_now_over_before']:.3f}** | {min(t):.3f} .. {max(t):.3f} |")
    return "\n".join(lines) + "\n"


def shown_command(argv: list[str], against_commit: str) -> str:
    """The command as run, with this machine's paths replaced by what they stand for."""
    placeholder = {"--against": f"CHECKOUT_OF_{against_commit}", "--work": "SCRATCH", "--out": "OUT"}
    shown, previous = [], ""
    for arg in argv:
        name = arg.split("=", 1)[0]
        if previous in placeholder:
            arg = placeholder[previous]
        elif "=" in arg and name in placeholder:
            arg = f"{name}={placeholder[name]}"
        shown.append(arg)
        previous = arg if arg in placeholder else ""
    return "python benchmarks/before_after.py " + " ".join(shown)


def commit_of(tree: Path) -> str:
    return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=tree, capture_output=True,
                          text=True).stdout.strip()


def comparison_report(against: Path, work: Path, script: str) -> dict[str, Any]:
    """Set up a two-checkout comparison (offline settings, a scratch MLflow store in `work`) and start its report:
    the command as run (no path of this machine), both commits and the machine."""
    for key, value in {"HF_HUB_OFFLINE": "1", "MLFLOW_DISABLE_TELEMETRY": "true", "TOKENIZERS_PARALLELISM": "false",
                       "DVC_NO_ANALYTICS": "1", "GX_ANALYTICS_ENABLED": "false"}.items():
        os.environ.setdefault(key, value)
    work.mkdir(parents=True, exist_ok=True)
    os.environ["MLFLOW_TRACKING_URI"] = f"sqlite:///{work / 'mlflow.db'}"
    import torch

    from components.tracking.run_environment import cpu_model

    command = shown_command(sys.argv[1:], commit_of(against)).replace("before_after.py", script)
    return {"command": command, "commit": commit_of(ROOT), "against_commit": commit_of(against),
            "machine": f"{cpu_model()}, {os.cpu_count()} CPUs ({torch.backends.cpu.get_cpu_capability()}), "
                       f"torch {torch.__version__}", "rows": []}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--against", required=True, help="the other checkout (with its own .venv)")
    parser.add_argument("--rows", default=",".join(ROWS))
    parser.add_argument("--rounds", type=int, default=0)
    parser.add_argument("--round-steps", type=int, default=0)
    parser.add_argument("--heldout", type=int, default=200)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--work", default=str(ROOT / "benchmarks" / ".work"))
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    parser.add_argument("--name", default="before_after",
                        help="the results files' name (benchmarks/results/NAME.{json,md}), e.g. packed_update")
    parser.add_argument("--update", action="store_true",
                        help="replace only the rows measured, keeping the others of the results file (same pair of "
                             "commits' base and machine), each row with its own commit and command")
    args = parser.parse_args()
    against, work = Path(args.against).resolve(), Path(args.work)
    report = comparison_report(against, work, "before_after.py")
    out = Path(args.out)
    json_path, md_path = out / f"{args.name}.json", out / f"{args.name}.md"
    earlier = json.loads(json_path.read_text()) if json_path.exists() else None
    if args.update and earlier and (earlier["against_commit"], earlier["machine"]) != (report["against_commit"],
                                                                                        report["machine"]):
        raise SystemExit(f"--update: {json_path} was measured against {earlier['against_commit']} on "
                         f"{earlier['machine']}; rows of another pair or machine are not mixed: run every row")
    for name in [r.strip() for r in args.rows.split(",") if r.strip()]:
        row = compare(name, against, args, work)
        report["rows"].append({**row, "commit": report["commit"], "command": report["command"]})
    write_report(report, earlier if args.update else None, json_path, md_path, markdown)
    return 0


def write_report(report: dict[str, Any], earlier: dict[str, Any] | None, json_path: Path, md_path: Path,
                 render: Any) -> None:
    """Keep `earlier`'s rows that were not measured again (each with its own commit and command), in the order of
    ROWS, then write the JSON and the page (`render`) and print the page."""
    if earlier:
        fresh = {r["row"] for r in report["rows"]}
        kept = [{"commit": earlier["commit"], "command": earlier["command"], **r} for r in earlier["rows"]
                if r["row"] not in fresh]
        order = {name: i for i, name in enumerate(ROWS)}
        report["rows"] = sorted(kept + report["rows"], key=lambda r: order.get(r["row"], len(order)))
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps(report, indent=2) + "\n")
    md_path.write_text(render(report))
    print(render(report))


if __name__ == "__main__":
    sys.exit(main())
