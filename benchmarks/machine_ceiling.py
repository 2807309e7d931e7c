"""This machine's own limits, to read a GRPO step's phases against: float32 matrix-multiply rate and memory bandwidth.

A phase's achieved fraction of the ceiling is what it did divided by what the machine can do:
- compute: model FLOPs from the parameter count N, counted as a plain forward does them (every row's prompt and
  completion; an engine that computes a group's prompt once or a repeated completion once can exceed the ceiling), 2N a
  token forward (generation, reference) and, for the policy
  update, 2N forward + 2N backward through the weights (activation gradients) + 2N for weight gradients when all
  weights train (LoRA's are negligible), over the phase's seconds. Attention's own FLOPs (a few percent at these
  lengths) are left out, so are recomputed layers: checkpointing costs time without adding counted work.
- bandwidth (decoding): every decode step reads all weights once, so decode steps x weight bytes over the
  generation seconds is a lower bound on what it moved (KV-cache reads come on top).

    python benchmarks/machine_ceiling.py            # prints both figures for 2 threads
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any


def matmul_gflops(threads: int, size: int = 1024, repeats: int = 20) -> float:
    """float32 GEMM rate at `threads` threads: the best of several [size x size] @ [size x size] products, the
    shape class of a policy forward over many rows (smaller products run below it)."""
    import torch

    torch.set_num_threads(threads)
    a, b = torch.randn(size, size), torch.randn(size, size)
    for _ in range(3):
        a @ b
    rates = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        a @ b
        rates.append(2 * size ** 3 / (time.perf_counter() - t0) / 1e9)
    return max(rates)


def bandwidth_gbs(threads: int, megabytes: int = 512, repeats: int = 10) -> float:
    """Memory bandwidth as a large float32 copy sees it (bytes read + written), best of `repeats`."""
    import torch

    torch.set_num_threads(threads)
    n = megabytes * 2 ** 20 // 4
    src, dst = torch.ones(n), torch.empty(n)
    dst.copy_(src)
    rates = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        dst.copy_(src)
        rates.append(2 * n * 4 / (time.perf_counter() - t0) / 1e9)
    return max(rates)


def ceiling(threads: int) -> dict[str, float]:
    return {"matmul_gflops": round(matmul_gflops(threads), 1), "bandwidth_gbs": round(bandwidth_gbs(threads), 1),
            "threads": threads}


def phase_utilisation(parameters: int, trainable: int, weight_bytes: int, steps: list[dict[str, float]],
                      machine: dict[str, float]) -> dict[str, Any]:
    """Achieved fraction of the ceiling per phase, from per-step records with `completions`, `tokens` (completion
    tokens), `prompt_tokens` (per row), `decode_steps` and the phase seconds."""
    def total(key: str) -> float:
        return sum(s.get(key, 0.0) for s in steps)

    rows_tokens = total("tokens") + sum(s["completions"] * s.get("prompt_tokens", 0.0) for s in steps)
    forward = 2 * parameters
    update = forward * 2 + (2 * parameters if trainable > parameters // 2 else 0)
    peak = machine["matmul_gflops"] * 1e9
    out: dict[str, Any] = {}
    if total("generation"):
        out["generation_flops_frac"] = round(forward * total("tokens") / total("generation") / peak, 3)
        if total("decode_steps"):
            out["generation_bandwidth_frac"] = round(total("decode_steps") * weight_bytes / total("generation")
                                                     / (machine["bandwidth_gbs"] * 1e9), 3)
    if total("policy"):
        out["policy_flops_frac"] = round(update * rows_tokens / total("policy") / peak, 3)
    measurable = 0.01 * (total("generation") + total("policy"))  # a phase that barely ran (no reference: beta 0)
    if total("reference") > measurable:
        out["reference_flops_frac"] = round(forward * rows_tokens / total("reference") / peak, 3)
    out["gflops_by_phase"] = {
        "generation": round(forward * total("tokens") / max(total("generation"), 1e-9) / 1e9, 1),
        "policy": round(update * rows_tokens / max(total("policy"), 1e-9) / 1e9, 1),
        "reference": round(forward * rows_tokens / total("reference") / 1e9, 1) if total("reference") > measurable
        else 0.0}
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    runs = [ceiling(args.threads) for _ in range(3)]
    print(f"matmul {statistics.median(r['matmul_gflops'] for r in runs):.1f} GFLOP/s, bandwidth "
          f"{statistics.median(r['bandwidth_gbs'] for r in runs):.1f} GB/s ({args.threads} threads)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
