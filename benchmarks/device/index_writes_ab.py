"""Generation on SmolLM2's shape (bf16, 64 rows x 128 tokens, LoRA) with the decode step's distinct-index writes
under the stage's deterministic mode (as before `static_cache.distinct_index_writes`), with them set aside (now), and
with deterministic mode off altogether; also the CUDA kernels one replayed step launches. One GPU call's diagnosis of
the first measured plan's generation rate, below its target. Prints one JSON line a variant and writes
$OUT/index_writes_ab.json (kept as benchmarks/results/gpu_index_writes_ab.json)."""

from __future__ import annotations

import contextlib
import json
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch

from benchmarks.gpu_rows_ours import Ours, grpo_config, random_prompts
from benchmarks.shapes import SHAPES, random_model
from components.engine.generation.engines import cuda_graphs, static_cache
from components.engine.generation.engines.base import SamplingParams
from components.engine.models.modeling import seed_everything

FIXED = static_cache.distinct_index_writes


def measure(variant: str, steps: int = 4) -> dict:
    writes = contextlib.nullcontext if variant == "sorted writes (before)" else FIXED
    static_cache.distinct_index_writes = cuda_graphs.distinct_index_writes = writes
    torch.use_deterministic_algorithms(variant != "determinism off", warn_only=True)
    device = torch.device(os.environ.get("DEVICE", "cuda"))
    shape, mode = os.environ.get("SHAPE", "smollm2-135m"), os.environ.get("MODE", "graphs")  # a CPU dry run: tiny
    cfg = grpo_config("lora", 128)
    vocab = SHAPES[shape]["vocab_size"]
    ids = random_prompts(cfg.grpo.prompts_per_step, 96, vocab, seed=3)
    ours = Ours(random_model(shape, torch.bfloat16, device), cfg, vocab, 96, device, mode, say=print)
    done = [ours.step(ids) for _ in range(steps)]
    rates = [s["tokens"] / s["generation_s"] for s in done[1:]]
    kernels = None
    if variant != "determinism off":
        from torch.profiler import ProfilerActivity, profile

        g = cfg.grpo  # the step's own settings: the captured graphs replay, nothing is recaptured
        params = SamplingParams(n=g.group_size, max_new_tokens=g.max_completion_length, temperature=g.temperature,
                                top_p=g.top_p, top_k=g.top_k, ignore_eos=True)
        with profile(activities=[ProfilerActivity.CUDA if device.type == "cuda" else ProfilerActivity.CPU]) as prof:
            ours.policy.engine.sample(ids, params)
            ours.clock()
        events = [e for e in prof.events() if e.device_type.name == "CUDA"]
        kernels = {"kernels_a_token": round(len(events) / g.max_completion_length, 1),
                   "top": [(e.key, round(e.self_device_time_total)) for e in sorted(
                       prof.key_averages(), key=lambda e: -e.self_device_time_total)[:6]]}
    out = {"variant": variant, "mode": ours.mode, "engine": ours.engine_name,
           "generation_tokens_per_s": round(statistics.median(rates)), "all": [round(r) for r in rates],
           "kernels": kernels}
    print(json.dumps(out), flush=True)
    del ours
    torch.cuda.empty_cache()
    return out


def main() -> None:
    seed_everything(0)
    rows = [measure(v) for v in ("distinct writes (now)", "sorted writes (before)", "determinism off")]
    static_cache.distinct_index_writes = cuda_graphs.distinct_index_writes = FIXED
    torch.use_deterministic_algorithms(True, warn_only=True)
    Path(os.environ.get("OUT", "/tmp")).joinpath("index_writes_ab.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
