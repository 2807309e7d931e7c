"""On a CUDA device: generation tokens/s and update-step MFU of a ~0.5B Qwen2-style config (random init).

Called by benchmarks/grpo_vs_trl.py when `torch.cuda.is_available()`; CPU-only runs never import it.
MFU = achieved model FLOPs (6 * parameters * tokens for forward + backward) / the GPU's bf16 dense peak.
"""

from __future__ import annotations

import time
from typing import Any

import torch

# Dense bf16 peak (FLOP/s) by device-name fragment; unknown devices report MFU as null.
BF16_PEAK = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12, "A10": 125e12, "L4": 121e12}


def qwen2_half_billion():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(vocab_size=32000, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                         num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=4096,
                         tie_word_embeddings=True)
    torch.manual_seed(0)
    return Qwen2ForCausalLM(config).to("cuda", dtype=torch.bfloat16)


def measure_gpu(prompts: int = 64, group_size: int = 8, prompt_len: int = 128, new_tokens: int = 256) -> dict[str, Any]:
    from components.engine.generation.engines.draw import sample_from
    from components.engine.generation.fast.build import checked_prefix_shared_lm
    from components.engine.generation.rollouts import Turn

    model = qwen2_half_billion()
    params = sum(p.numel() for p in model.parameters())
    fast = checked_prefix_shared_lm(model)
    vocab = model.config.vocab_size
    prompt_ids = torch.randint(0, vocab, (prompts, prompt_len), device="cuda")
    mask = torch.ones_like(prompt_ids)
    # Generation: prompt once, G copies decoded with the preallocated cache.
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    with torch.no_grad():
        decoder = fast.start_decoding(prompt_ids, mask, group_size, new_tokens)
        tokens = []
        logits = decoder.logits
        for _ in range(new_tokens - 1):
            nxt = sample_from(torch.softmax(logits.float(), -1))  # the engine's sampler
            tokens.append(nxt)
            logits = decoder.feed(nxt)
        tokens.append(sample_from(torch.softmax(logits.float(), -1)))
    torch.cuda.synchronize()
    gen_seconds = time.perf_counter() - t0
    completion = torch.stack(tokens, 1)
    rows = prompts * group_size
    rollout = Turn(prompt_ids.repeat_interleave(group_size, 0), mask.repeat_interleave(group_size, 0), completion,
                      torch.ones_like(completion), torch.zeros(rows, dtype=torch.bool, device="cuda"))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)
    times = []
    for _ in range(4):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logp, _ = fast.completion_logprobs(rollout)
        (-(logp.float().mean())).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    update_seconds = sorted(times[1:])[len(times[1:]) // 2]
    # Tokens actually computed: each prompt once, then every completion token but the last.
    tokens_computed = prompts * prompt_len + rows * (new_tokens - 1)
    achieved = 6 * params * tokens_computed / update_seconds
    name = torch.cuda.get_device_name()
    peak = next((v for k, v in BF16_PEAK.items() if k in name), None)
    return {"device": name, "parameters": params, "generation_tokens_per_s": round(rows * new_tokens / gen_seconds),
            "update_seconds": round(update_seconds, 4), "update_tflops": round(achieved / 1e12, 1),
            "mfu": None if peak is None else round(achieved / peak, 3)}
