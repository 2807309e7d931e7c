"""benchmarks/gpu_rows.py's side of this pipeline: a GRPO step through the rollout door (`build_engine`), the update
(`policy_updates`) and optimizer (`make_optimizer`), timed by phase, with the on-policy gap the update measures and
the card's peak memory; plus the set-up both sides share (config, prompts, tokenizer, clocks)."""

from __future__ import annotations

import copy
import statistics
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
REASONING = "configs/examples/smollm2_reasoning.yaml"
MODES = {"lora": [], "full": ["grpo.lora.enabled=false", "grpo.learning_rate=0.00001"],
         "lora-nf4": ["grpo.lora.quantize_base=nf4"]}


def grpo_config(mode: str, length: int, extra: list[str] | tuple[str, ...] = (), prompts: int = 8, group: int = 8):
    """The whole pipeline config of a row: params.yaml, the reasoning example, the row's mode and shape."""
    from pipelines.params_io import merged_config

    return merged_config(ROOT / "params.yaml", [ROOT / REASONING],
                         [*MODES[mode], f"grpo.max_completion_length={length}", f"grpo.prompts_per_step={prompts}",
                          f"grpo.group_size={group}", *extra])


def word_tokenizer(vocab: int):
    """A tokenizer whose words "w0" .. are token ids 0 ..: prompt texts TRL tokenises into the ids ours samples
    from (random weights need no real vocabulary). EOS is the last id, padding the one before."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = {f"w{i}": i for i in range(vocab - 2)} | {"<pad>": vocab - 2, "<eos>": vocab - 1}
    backend = Tokenizer(models.WordLevel(vocab=words, unk_token="<pad>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", eos_token="<eos>",
                                   padding_side="left")


def random_prompts(count: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    import torch

    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab - 2, (count, length), generator=gen).tolist()


class Clock:
    """Wall-clock seconds after the card has finished what was queued."""

    def __init__(self, device):
        import torch

        self.sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def __call__(self) -> float:
        self.sync()
        return time.perf_counter()


def reset_peak() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()


def peak_memory() -> dict[str, float | None]:
    """The card's peak allocated and reserved GiB since `reset_peak` (None on the CPU)."""
    import torch

    if not torch.cuda.is_available():
        return {"peak_allocated_gb": None, "peak_reserved_gb": None}
    return {"peak_allocated_gb": round(torch.cuda.max_memory_allocated() / 2**30, 2),
            "peak_reserved_gb": round(torch.cuda.max_memory_reserved() / 2**30, 2)}


class Ours:
    """This pipeline's engine through its door, its update and optimizer (float32 masters for bf16 full fine-tuning),
    on a model it is handed. `engine_mode` (CPU rehearsals only): the CUDA-graph engine in that mode in place of the
    prompt-once engine the door gives without CUDA."""

    def __init__(self, model, cfg, vocab: int, prompt_tokens: int, device, engine_mode: str | None = None,
                 tokens: Any = None, say=print):
        import torch

        from components.engine.generation.engines.base import EngineRun, SpecialTokens
        from components.engine.generation.engines.choose import build_engine
        from components.engine.generation.engines.cuda_graphs import CudaGraphEngine
        from components.engine.grpo.memory_estimate import fit_memory
        from components.engine.grpo.objectives import build_loss
        from components.engine.grpo.policy import Policy, attach_lora
        from components.engine.models.optim import make_optimizer
        from components.engine.models.quantize import nf4_count
        from components.rollout_engines import engine_settings

        g = self.g = cfg.grpo
        self.loss, self.device = build_loss(g), device
        if g.lora.enabled:
            model = attach_lora(model, g.lora)  # a 4-bit base is quantized here, where the model already is
        self.quantized = nf4_count(model)
        reference = None
        if self.loss.uses_reference and not g.lora.enabled:
            reference = copy.deepcopy(model).eval().requires_grad_(False)
        fit = fit_memory(g, model, prompt_tokens, reference is not None, say)
        self.checkpointing = fit.gradient_checkpointing
        self.tokens = tokens or SpecialTokens(eos_id=vocab - 1, pad_id=vocab - 2)
        run = EngineRun(vocab_size=vocab, max_length=prompt_tokens + g.max_completion_length,
                        completion_length=g.max_completion_length, gradient_checkpointing=fit.gradient_checkpointing)
        engine = build_engine(model.train(), self.tokens, run, engine_settings(g), say)
        if engine_mode and engine.name == "prefix_shared":  # a CPU rehearsal: the graph engine's fused loop
            engine = CudaGraphEngine(engine, engine_mode, run.max_length, say=say)
        self.model, self.engine_name = model, engine.name
        self.policy = Policy.of(None, model, engine, reference, g.lora.enabled, self.loss.uses_reference,
                                temperature=g.temperature)
        self.optimizer = make_optimizer(model, g.learning_rate, g.weight_decay, device)
        self.generator = torch.Generator(device=device).manual_seed(1)
        self.clock = Clock(device)
        self.check_quantized()

    @property
    def mode(self) -> str | None:
        """The CUDA-graph engine's decoding mode (`token_loop` after a failed capture), else None."""
        return getattr(self.policy.engine, "mode", None)

    def check_quantized(self) -> None:
        """A 4-bit base must still be NF4 (a move with a dtype would have dequantized it)."""
        from components.engine.models.quantize import nf4_count

        if self.g.lora.quantize_base == "nf4" and (self.quantized == 0 or nf4_count(self.model) != self.quantized):
            raise RuntimeError(f"the 4-bit base is not NF4 any more ({nf4_count(self.model)} of {self.quantized})")

    def step(self, prompts: list[list[int]], ignore_eos: bool = True) -> dict[str, Any]:
        """One GRPO step on `prompts` (random advantages: the update runs whatever the rewards): seconds by phase,
        completion tokens, the on-policy gap the update measured and the card's peak memory."""
        import torch

        from components.engine.generation.engines.base import SamplingParams
        from components.engine.grpo.trajectory import Trajectory
        from components.engine.grpo.update import UpdatePlan, policy_updates, reference_logprobs

        g, policy = self.g, self.policy
        params = SamplingParams(n=g.group_size, max_new_tokens=g.max_completion_length, temperature=g.temperature,
                                top_p=g.top_p, top_k=g.top_k, ignore_eos=ignore_eos)
        reset_peak()
        t0 = self.clock()
        rollouts = policy.engine.sample(prompts, params, self.generator)
        t1 = self.clock()
        advantages = torch.randn(len(rollouts), generator=self.generator, device=self.device)
        plan = UpdatePlan.of(len(rollouts), rollouts.group_size, g)
        ref = reference_logprobs(policy, rollouts, plan) if self.loss.uses_reference else None
        t2 = self.clock()
        scorable = torch.ones(len(rollouts), dtype=torch.bool, device=self.device)
        stats = policy_updates(policy, self.optimizer, Trajectory(rollouts, advantages,
                                                                  rollouts.completion_mask.float(), scorable, ref),
                               g, self.loss, plan)
        t3 = self.clock()
        self.check_quantized()
        lengths = rollouts.completion_mask.sum(-1)
        return {"generation_s": t1 - t0, "reference_s": t2 - t1, "update_s": t3 - t2, "step_s": t3 - t0,
                "tokens": int(lengths.sum()), "rows": len(rollouts), "mean_length": float(lengths.float().mean()),
                "ended_at_eos": float((~rollouts.truncated).float().mean()),
                "on_policy_gap": stats.gap_sum / stats.gap_tokens if stats.gap_tokens else None,
                "on_policy_gap_max": stats.gap_max if stats.gap_tokens else None, **peak_memory()}


def median_of(steps: list[dict[str, Any]], key: str) -> float:
    timed = steps[1:] or steps  # the first step warms kernels, captures and the allocator up
    return statistics.median(s[key] for s in timed)


def summary(steps: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians of the timed steps (all but the first), the largest peaks and gaps of all."""
    tokens = median_of(steps, "tokens")
    out: dict[str, Any] = {k: round(median_of(steps, k), 4)
                           for k in ("generation_s", "reference_s", "update_s", "step_s")}
    out.update(tokens=tokens, completion_tokens_per_s=round(tokens / out["step_s"], 1),
               generation_tokens_per_s=round(tokens / out["generation_s"], 1) if out["generation_s"] else None,
               timed_steps=len(steps[1:] or steps))
    for key in ("peak_allocated_gb", "peak_reserved_gb", "on_policy_gap_max"):
        values = [s[key] for s in steps if s.get(key) is not None]
        out[key] = max(values) if values else None
    gaps = [s["on_policy_gap"] for s in steps if s.get("on_policy_gap") is not None]
    out["on_policy_gap"] = round(max(gaps), 6) if gaps else None  # the worst step's mean gap
    for key in ("mean_length", "ended_at_eos"):
        if all(key in s for s in steps):
            out[key] = round(median_of(steps, key), 3)
    return out


def limits(ceiling: dict[str, Any], row: dict[str, Any], spec: dict[str, Any], prompts_per_step: int,
           ours: dict[str, Any], ran_reference: bool) -> dict[str, Any]:
    """How far a row is from the card: decoding against bandwidth, the update against the bf16 matrix rate.

    `update_mfu` is model FLOPs utilisation as PaLM defines it: the FLOPs the update needs (6 per parameter and
    token for full fine-tuning: forward, input and weight gradients; 4 for LoRA, whose frozen weights get no
    gradient), recomputation not counted; `update_hfu` (hardware FLOPs utilisation) counts the forward that
    gradient checkpointing runs again. The reference's utilisation only on rows that ran one. A figure above its
    physical bound (a share above 1: a timing that cannot be) is left out and named in `out_of_bound`."""
    n, rows, length, prompt = row["parameters"], row["rows"], row["length"], row["prompt_tokens"]
    head_dim = spec["hidden_size"] // spec["num_attention_heads"]
    kv_per_token = spec["num_hidden_layers"] * 2 * spec["num_key_value_heads"] * head_dim * 2  # bf16 keys + values
    step_bytes = 2 * n + rows * kv_per_token * (prompt + length / 2)  # weights once + the average cache read
    floor_generation = length * step_bytes / (ceiling["bandwidth_gbs"] * 1e9)
    fed = rows * length + prompts_per_step * prompt  # each prompt once, every completion token
    model_per_token = 4 if row["mode"].startswith("lora") else 6
    hardware_per_token = model_per_token + (2 if ours.get("gradient_checkpointing") else 0)
    peak = ceiling["bf16_tflops"] * 1e12
    shares = {"generation_share_of_bandwidth": floor_generation / ours["generation_s"],
              "update_mfu": model_per_token * n * fed / ours["update_s"] / peak,
              "update_hfu": hardware_per_token * n * fed / ours["update_s"] / peak}
    if ran_reference and ours.get("reference_s"):
        shares["reference_mfu"] = 2 * n * fed / ours["reference_s"] / peak
    out: dict[str, Any] = {"decode_step_mb": round(step_bytes / 2**20, 1),
                           "generation_floor_s": round(floor_generation, 4),
                           "update_tflops": round(model_per_token * n * fed / ours["update_s"] / 1e12, 1)}
    beyond = {name for name, share in shares.items() if share > 1.0}
    if "update_hfu" in beyond:  # the update's clock cannot be right: neither of its utilisations is shown
        beyond.add("update_mfu")
    out.update({name: round(share, 3) for name, share in shares.items() if name not in beyond})
    if beyond:
        out["out_of_bound"] = sorted(beyond)
    return out
