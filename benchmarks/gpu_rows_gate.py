"""benchmarks/gpu_rows.py's first phase: is the engine the rows would time the one they claim to time?

At SmolLM2-135M's shape in bfloat16 (random weights), under the grpo stage's determinism setting, the door
(`build_engine`) must give the CUDA-graph engine in graph mode (not the prompt-once fallback, not the token loop
after a failed capture); captured and eager greedy decoding must give the same tokens over `GREEDY_STEPS` steps; a
sampled run's sampler log-probs must sit within `MAX_GAP` nats on average of the trainer's log-probs of the same
tokens (the engine's own forward) and within `MAX_PLAIN_GAP` of the plain Hugging Face forward's (eager
attention, unfused, uncaptured: kernels the captured step does not share, so its agreement is not by construction),
and within `MAX_TOKEN_GAP` on any one token of either. It also says which attention kernel a masked bfloat16 call
takes on this card and in what memory layout its output comes back, how many graphs were captured and how long
capturing took. Meant to be short; `passed` False stops the plan (gpu_rows.py exits non-zero) unless told to keep
going.
"""

from __future__ import annotations

import time
from typing import Any

GREEDY_STEPS = 32
MAX_GAP = 0.05  # nats, mean over a sampled run's tokens, against the trainer (the engine's own forward)
MAX_PLAIN_GAP = 0.1  # the same against the plain forward, whose other kernels round otherwise (CPU bfloat16: 0.03)
MAX_TOKEN_GAP = 1.0  # nats, the largest single token's gap (a trained model's bfloat16 tokens reach about 0.75)
PROMPTS, GROUP, PROMPT_TOKENS = 8, 8, 64


def attention_kernel(device, dtype, heads: int = 9, kv_heads: int = 3, head_dim: int = 64) -> dict[str, Any]:
    """The SDPA kernel a masked call of the CUDA-graph step's shape takes here, the memory layout of its output,
    and which backends can run it at all."""
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils._python_dispatch import TorchDispatchMode

    rep = heads // kv_heads
    q = torch.randn(64, kv_heads, rep, head_dim, device=device, dtype=dtype)
    k = torch.randn(64, kv_heads, 256, head_dim, device=device, dtype=dtype)
    mask = torch.zeros(64, 1, 1, 256, device=device, dtype=dtype)
    seen: list[str] = []

    class Seen(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if "scaled_dot_product" in func.overloadpacket.__name__:
                seen.append(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    with Seen():
        out = torch.nn.functional.scaled_dot_product_attention(q, k, k, attn_mask=mask)
    runs = []
    for backend in (SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
                    SDPBackend.MATH):
        try:
            with sdpa_kernel(backend):
                torch.nn.functional.scaled_dot_product_attention(q, k, k, attn_mask=mask)
            runs.append(backend.name)
        except RuntimeError:
            pass
    return {"kernel": seen[-1] if seen else None, "output_contiguous": out.is_contiguous(),
            "output_strides": list(out.stride()), "backends_that_run": runs}


def gate(args, say=print) -> dict[str, Any]:
    """The checks above; returns what it found, with `passed` and, when it failed, `why`."""
    import torch

    from benchmarks.gpu_rows_ours import Clock, grpo_config, random_prompts
    from benchmarks.shapes import SHAPES, random_model
    from components.engine.generation.engines.base import EngineRun, SamplingParams, SpecialTokens
    from components.engine.generation.engines.choose import build_engine
    from components.engine.generation.engines.cuda_graphs import CudaGraphEngine
    from components.rollout_engines import engine_settings

    started = time.perf_counter()
    device, dtype, shape = torch.device(args.device), getattr(torch, args.dtype), args.long_shape
    vocab = SHAPES[shape]["vocab_size"]
    found: dict[str, Any] = {"shape": shape, "dtype": args.dtype, "deterministic":
                             torch.are_deterministic_algorithms_enabled(), "expected_mode": args.expect_mode}
    found["attention"] = attention_kernel(device, dtype, SHAPES[shape]["num_attention_heads"],
                                          SHAPES[shape]["num_key_value_heads"],
                                          SHAPES[shape]["hidden_size"] // SHAPES[shape]["num_attention_heads"])
    say(f"  attention: {found['attention']}", flush=True)
    model = random_model(shape, dtype, device).train()
    tokens = SpecialTokens(eos_id=vocab - 1, pad_id=vocab - 2)
    lines: list[str] = []
    run = EngineRun(vocab_size=vocab, max_length=PROMPT_TOKENS + GREEDY_STEPS, completion_length=GREEDY_STEPS)
    engine = build_engine(model, tokens, run, engine_settings(grpo_config("lora", GREEDY_STEPS).grpo),
                          say=lambda *a, **_k: lines.append(" ".join(map(str, a))))
    found.update(door_engine=engine.name, door_said=lines)
    if engine.name == "prefix_shared" and args.expect_mode != "graphs":  # a CPU rehearsal
        engine = CudaGraphEngine(engine, args.expect_mode, run.max_length, say=lines.append)
    found["mode"] = getattr(engine, "mode", None)
    if engine.name != "cuda_graphs" or found["mode"] != args.expect_mode:
        return _failed(found, started, f"the door gave {engine.name} ({found['mode']}), not cuda_graphs in "
                                       f"{args.expect_mode} mode: {' | '.join(lines)}")
    count, group = (PROMPTS, GROUP) if args.device == "cuda" else (2, 4)  # a CPU rehearsal: fewer rows
    prompts = random_prompts(count, PROMPT_TOKENS, vocab, seed=11)
    greedy = SamplingParams(n=group, max_new_tokens=GREEDY_STEPS, greedy=True, ignore_eos=True)
    clock = Clock(device)
    t0 = clock()
    captured = engine.sample(prompts, greedy)
    t1 = clock()
    again = engine.sample(prompts, greedy)
    t2 = clock()
    found.update(graphs=len(engine.graphs), first_run_s=round(t1 - t0, 3), replay_run_s=round(t2 - t1, 3),
                 capture_s=round((t1 - t0) - (t2 - t1), 3) if engine.graphs else None, mode_after=engine.mode)
    if engine.mode != args.expect_mode:
        return _failed(found, started, f"decoding fell back to {engine.mode}: {' | '.join(lines)}")
    eager = CudaGraphEngine(engine.base, "eager", run.max_length).sample(prompts, greedy)
    found["greedy_agree"] = bool(torch.equal(captured.completion_ids, eager.completion_ids)
                                 and torch.equal(captured.completion_ids, again.completion_ids))
    if not found["greedy_agree"]:
        differ = (captured.completion_ids != eager.completion_ids).any(-1).sum()
        return _failed(found, started, f"captured and eager greedy tokens differ in {int(differ)} of "
                                       f"{len(eager)} rows over {GREEDY_STEPS} steps")
    found.update(_gap(engine, model, prompts, group, torch.Generator(device=device).manual_seed(5)))
    for against, prefix, bound in (("trainer", "gap", MAX_GAP), ("plain Hugging Face forward", "plain_gap",
                                                                  MAX_PLAIN_GAP)):
        mean, largest = found[f"{prefix}_mean"], found[f"{prefix}_max"]
        if not (mean < bound and largest < MAX_TOKEN_GAP):
            return _failed(found, started, f"sampler vs {against} log-prob gap {mean:.4f} nats on average (at most "
                                           f"{bound}), {largest:.4f} on one token (at most {MAX_TOKEN_GAP})")
    found.update(passed=True, seconds=round(time.perf_counter() - started, 1))
    return found


def _gap(engine, model, prompts, group: int, generator) -> dict[str, Any]:
    """A sampled run's sampler log-probs against the trainer's forward of the same tokens and against the plain
    Hugging Face forward's (no gradient)."""
    import torch

    from components.engine.generation.engines.base import SamplingParams
    from components.engine.generation.logprobs import completion_logprobs

    rollouts = engine.sample(prompts, SamplingParams(n=group, max_new_tokens=GREEDY_STEPS, temperature=1.0,
                                                     ignore_eos=True), generator)
    mask = rollouts.completion_mask.bool()
    found: dict[str, Any] = {"gap_tokens": int(mask.sum())}
    with torch.no_grad():
        trainer = engine.logprobs(rollouts, 1.0)[0]
        attention = model.config._attn_implementation
        switch = getattr(model, "set_attn_implementation", None)  # eager attention: no kernel shared with the step
        if switch is not None:
            switch("eager")
        try:
            plain = completion_logprobs(model, rollouts, 1.0)[0]
        finally:
            if switch is not None:
                switch(attention)
    found["plain_attention"] = "eager" if switch is not None else attention
    for prefix, logp in (("gap", trainer), ("plain_gap", plain)):
        gap = (logp.float() - rollouts.sampling_logp)[mask].abs()
        found.update({f"{prefix}_mean": round(float(gap.mean()), 5), f"{prefix}_max": round(float(gap.max()), 5)})
    return found


def _failed(found: dict[str, Any], started: float, why: str) -> dict[str, Any]:
    return {**found, "passed": False, "why": why, "seconds": round(time.perf_counter() - started, 1)}
