"""Peak resident memory of a GRPO step against completion length: SmolLM2-135M, LoRA and full fine-tuning.

Each measurement is one process that builds the policy exactly as the grpo stage does (params.yaml + the SmolLM2
example + overrides), then runs `--steps` GRPO steps of 64 completions (8 prompts x 8): sampling with EOS
ignored, so every completion is `max_completion_length` tokens long (the worst case a length budget allows),
the reference forward when the loss has a KL term, and the policy update. The figure is the process's peak
resident set (`ru_maxrss`: model, optimizer state, sampling, activations), the number a machine's memory
has to hold. A watchdog stops a process that passes `--cap-gb` (below the machine's memory), reported as "> cap".

`--before COMMIT` measures the engine of another commit too (a git worktree, the same worker), engines
alternating per length, so "before" and "after" come from one sitting on one machine.

    python benchmarks/long_completions.py                                  # after only
    python benchmarks/long_completions.py --before 8cd25d5 --lengths 32,96,128,256,512 --steps 1 --update
    python benchmarks/long_completions.py --lengths 96 --modes lora --variants plain

Writes benchmarks/results/long_completions.{json,md}. Not a test: it reports figures, it does not assert them.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import resource
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
# A worker imports the engine of the tree it runs in (this checkout, or another commit's worktree).
sys.path.insert(0, os.environ.get("BENCH_TREE", str(ROOT)) if "--worker" in sys.argv else str(ROOT))

SMOLLM2 = "configs/examples/smollm2_addition.yaml"
MODES = {"lora": [], "full": ["grpo.lora.enabled=false", "grpo.learning_rate=0.00001"]}
# Engine settings measured "after": the chunked vocabulary head is always on; checkpointing is a config key.
VARIANTS = {"auto": [], "never": ["grpo.gradient_checkpointing=never"],
            "always": ["grpo.gradient_checkpointing=always"],
            "always+mb16": ["grpo.gradient_checkpointing=always", "grpo.minibatch_size=16"]}


# ------------------------------------------------------------------------------------------------ worker
def worker(start: Path, overrides: list[str], steps: int, threads: int, device: str = "cpu") -> dict[str, Any]:
    """Build the policy as the grpo stage does and run `steps` full-length steps; report seconds and peak RSS
    (and, on a GPU, the allocator's peak GPU memory)."""
    import torch

    from components.data.paths import Paths
    from components.data.records import read_jsonl, split_path
    from components.engine.grpo.batch import sampling_params
    from components.engine.grpo.objectives import build_loss
    from components.engine.grpo.policy import build_policy
    from components.engine.grpo.trajectory import Trajectory
    from components.engine.grpo.update import UpdatePlan, policy_updates, reference_logprobs
    from components.engine.models.modeling import resolve_model_dir, seed_everything
    from components.engine.models.optim import make_optimizer
    from pipelines.params_io import merged_config

    tree = Path(os.environ.get("BENCH_TREE", ROOT))
    cfg = merged_config(tree / "params.yaml", [tree / SMOLLM2], [f"threads={threads}", *overrides])
    g = cfg.grpo
    seed_everything(cfg.seed, cfg.threads)
    paths = Paths(root=start)
    records = read_jsonl(split_path(paths.data, "train"))[: g.prompts_per_step]
    loss = build_loss(g)
    dev = torch.device(device)
    cuda = dev.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    # Built as the grpo stage builds it: gradient checkpointing under `auto` and the allocator from the estimate.
    policy, fit = build_policy(cfg, resolve_model_dir(paths.sft_model), dev, records,
                               with_reference=loss.uses_reference)
    optimizer = make_optimizer(policy.model, g.learning_rate, g.weight_decay, dev)
    estimate = {"estimate_gb": fit.memory.peak / 2**30, "checkpointing": fit.gradient_checkpointing}
    built_gb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    params = dataclasses.replace(sampling_params(g), ignore_eos=True)  # every completion at the budget
    generator = torch.Generator(device=dev).manual_seed(cfg.seed)
    clock = (lambda: (torch.cuda.synchronize(), time.perf_counter())[1]) if cuda else time.perf_counter
    timings: list[dict[str, float]] = []
    for _ in range(steps):
        t0 = clock()
        rollout = policy.sample(records, params, generator)
        t1 = clock()
        advantages = torch.randn(len(rollout), generator=generator, device=dev)
        plan = UpdatePlan.of(len(rollout), rollout.group_size, g)
        ref_logp = reference_logprobs(policy, rollout, plan) if loss.uses_reference else None
        t2 = clock()
        policy_updates(policy, optimizer, Trajectory(rollout, advantages, rollout.completion_mask.float(),
                                                     torch.ones(len(rollout), dtype=torch.bool, device=dev), ref_logp),
                       g, loss, plan)
        t3 = clock()
        timings.append({"generation_s": t1 - t0, "reference_s": t2 - t1, "update_s": t3 - t2,
                        "tokens": int(rollout.completion_mask.sum())})
    last = {k: sorted(t[k] for t in timings[1:] or timings)[len(timings[1:] or timings) // 2] for k in timings[-1]}
    return {"peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, "built_rss_gb": built_gb,
            **estimate, **last,
            "completion_tokens_per_s": last["tokens"] / (last["generation_s"] + last["reference_s"] + last["update_s"]),
            "fast_path": policy.engine.name == "prefix_shared",
            **({"peak_gpu_allocated_gb": torch.cuda.max_memory_allocated() / 2**30,
                "peak_gpu_reserved_gb": torch.cuda.max_memory_reserved() / 2**30} if cuda else {})}


# -------------------------------------------------------------------------------------------- controller
def measure(tree: Path, start: Path, overrides: list[str], steps: int, threads: int, cap_gb: float) -> dict[str, Any]:
    """One worker process in `tree` (this checkout or a worktree), stopped if its resident set passes the cap."""
    import psutil

    with tempfile.NamedTemporaryFile("r", suffix=".json") as out:
        cmd = [sys.executable, str(ROOT / "benchmarks" / "long_completions.py"), "--worker", "--out", out.name,
               "--start", str(start), "--steps", str(steps), "--threads", str(threads), "--", *overrides]
        env = {**os.environ, "PYTHONPATH": str(tree), "BENCH_TREE": str(tree), "HF_HUB_OFFLINE": "1",
               "GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"}  # as the CLI sets for every stage process
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        peak, stopped = 0.0, threading.Event()

        def watch() -> None:
            nonlocal peak
            handle = psutil.Process(proc.pid)
            while proc.poll() is None:
                try:
                    rss = handle.memory_info().rss / 2**30
                except psutil.Error:
                    return
                peak = max(peak, rss)
                if rss > cap_gb:
                    stopped.set()
                    proc.kill()
                    return
                time.sleep(0.1)

        watcher = threading.Thread(target=watch, daemon=True)
        t0 = time.perf_counter()
        watcher.start()
        log, _ = proc.communicate()
        watcher.join()
        if stopped.is_set():
            return {"peak_rss_gb": None, "over_cap_gb": cap_gb, "seconds": time.perf_counter() - t0}
        if proc.returncode != 0:
            return {"peak_rss_gb": None, "error": log.strip().splitlines()[-1:] or [f"exit {proc.returncode}"],
                    "seconds": time.perf_counter() - t0}
        return {**json.loads(Path(out.name).read_text()), "seconds": time.perf_counter() - t0}


def worktree(commit: str) -> Path:
    """A checkout of `commit` beside this one (reused), for measuring its engine with the same worker."""
    path = ROOT / "benchmarks" / ".work" / f"tree-{commit}"
    if not path.exists():
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(path), commit], check=True,
                       capture_output=True)
    return path


def table(results: list[dict[str, Any]]) -> str:
    lines = ["| engine | mode | checkpointing | completion tokens | peak RSS | estimate | generation | update "
             "| completion tokens/s |", "|---|---|---|---:|---:|---:|---:|---:|---:|"]
    for r in results:
        peak = f"{r['peak_rss_gb']:.2f} GB" if r.get("peak_rss_gb") else (
            f"> {r['over_cap_gb']:.0f} GB (stopped)" if r.get("over_cap_gb") else f"failed: {r.get('error')}")
        def secs(key: str, r: dict[str, Any] = r) -> str:
            return f"{r[key]:.1f} s" if key in r else "-"
        rate = f"{r['completion_tokens_per_s']:.0f}" if "completion_tokens_per_s" in r else "-"
        estimate = f"{r['estimate_gb']:.1f} GB" if r.get("estimate_gb") else "-"
        setting = r["variant"] + (" (on)" if r.get("checkpointing") else " (off)" if "checkpointing" in r else "")
        lines.append(f"| {r['engine']} | {r['mode']} | {setting} | {r['length']} | {peak} | {estimate} | "
                     f"{secs('generation_s')} | {secs('update_s')} | {rate} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", default="32,128,256,512")
    parser.add_argument("--modes", default="lora,full")
    parser.add_argument("--variants", default="auto", help=f"gradient checkpointing settings, of {list(VARIANTS)}")
    parser.add_argument("--before", default=None, help="also measure this commit's engine (a git worktree)")
    parser.add_argument("--before-lengths", default="32,96,128,256", help="the lengths measured with --before")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--cap-gb", type=float, default=20.0)
    parser.add_argument("--update", action="store_true", help="write benchmarks/results/NAME.{json,md}")
    parser.add_argument("--name", default="long_completions", help="the results file's name")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--start", help=argparse.SUPPRESS)
    parser.add_argument("overrides", nargs="*", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        Path(args.out).write_text(json.dumps(worker(Path(args.start), args.overrides, args.steps, args.threads)))
        return

    import torch

    from benchmarks.grpo_vs_trl import ROWS, prepare_start

    start = prepare_start(ROWS["smollm2-lora"], ROOT / "benchmarks" / ".work", args.threads)
    engines = [("after", ROOT)] + ([(f"before ({args.before})", worktree(args.before))] if args.before else [])
    results = []
    for length in [int(x) for x in args.lengths.split(",")]:
        for mode in args.modes.split(","):
            for engine, tree in engines:
                if tree != ROOT and str(length) not in args.before_lengths.split(","):
                    continue
                variants = args.variants.split(",") if tree == ROOT else ["-"]
                for variant in variants:
                    overrides = [f"grpo.max_completion_length={length}", *MODES[mode],
                                 *(VARIANTS[variant] if tree == ROOT else [])]
                    r = measure(tree, start, overrides, args.steps, args.threads, args.cap_gb)
                    results.append({"engine": engine, "mode": mode, "variant": variant, "length": length, **r})
                    print(table(results[-1:]).splitlines()[-1], flush=True)
    commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())
    report = {"commit": commit, "machine": f"{cpu}, {os.cpu_count()} CPUs ({torch.backends.cpu.get_cpu_capability()}), "
                                           f"{args.threads} threads, torch {torch.__version__}",
              "completions_per_step": 64, "steps": args.steps, "cap_gb": args.cap_gb, "results": results}
    print(table(results))
    if args.update:
        out = ROOT / "benchmarks" / "results"
        (out / f"{args.name}.json").write_text(json.dumps(report, indent=1) + "\n")
        (out / f"{args.name}.md").write_text(
            f"# Peak resident memory of a GRPO step against completion length\n\n"
            f"SmolLM2-135M-Instruct, 8 prompts x 8 completions, every completion at the length budget (EOS "
            f"ignored), {args.steps} step(s), peak RSS of the process; seconds are those of the last step. "
            f"Machine: {report['machine']}.\n\n`python benchmarks/long_completions.py {' '.join(sys.argv[1:])}`"
            f"\n\n{table(results)}\n")


if __name__ == "__main__":
    main()
