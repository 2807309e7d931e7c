"""On one GPU: the long row against TRL on the same card, and the scale rows (0.5B, 1.5B), in one command.

Phases, in order of what matters most (each row is saved as soon as it is measured; `--budget-s` skips what would
not finish in time, and says so):
  1. the card: name, torch / CUDA / transformers / TRL versions, its measured ceilings (a device-to-device copy's
     bandwidth, a bf16 8192^3 matrix product's rate);
  2. the GPU-only tests (`pytest -m gpu`: captured decoding against uncaptured, the door choosing it);
  3. (a) the long row: SmolLM2-135M's shape, LoRA rank 16 and full fine-tuning, 64 completions a step (8 prompts x
     8) at 128 and 512 tokens, ours and TRL's GRPOTrainer taking turns step by step in one process on the same card
     (TRL's loop calls ours between its steps; the first step of each is a warm-up). Every completion at the budget
     (ours: `SamplingParams(ignore_eos=True)`; TRL: `min_new_tokens`), so both generate the same token count.
     TRL at its best settings without vLLM (not installable on these machines): bf16 weights, no gradient
     checkpointing, one generation batch of all 64 completions, Hugging Face `generate`. Completion tokens/s of the
     whole step and of generation alone, peak GPU memory of each engine's steps;
  4. (b) the scale rows: randomly initialised Qwen2.5-shaped models (Llama architecture with q|k|v biases) of 0.49B
     and 1.54B parameters, LoRA, full fine-tuning and LoRA over a 4-bit base (`lora-nf4`), 64 x 512 tokens, KL term
     on (a reference forward): tokens/s of each phase, the update's model FLOP utilisation, peak GPU memory;
  5. the measured option `compile_step` (Inductor-compiled decode step inside the graphs) on the long row's shape;
  6. with `--gguf` (the SmolLM2-135M-Instruct GGUF, e.g. carried in two halves and joined): held-out reward after
     equal completions, ours (the grpo stage itself, tracking off) and TRL from the same SFT warm start, and ours
     with a 4-bit frozen base (`lora-nf4`: TRL's 4-bit path is bitsandbytes, not on these machines).

Every row says how far it is from the card: decoding against memory bandwidth (bytes a decode step must read:
the weights once, plus each row's cached keys and values), the update against the bf16 matrix rate (model FLOPs:
2N a token forward, 4N forward + backward with LoRA, 6N full, 2N more under gradient checkpointing). Targets
(issue 55), the constants of benchmarks/gpu_rows_report.py: the long row's whole step at `LONG_STEP_TOKENS_S`
completion tokens/s and `LONG_VS_TRL` times TRL; 135M generation at 64 rows at `GENERATION_TOKENS_S` tokens/s; 1.5B
full fine-tuning at 64 x 512 within one card of `FULL_1_5B_GB`.

    python benchmarks/gpu_rows.py --out $OUT                      # on the GPU machine (tracking off, no MLflow)
    python benchmarks/gpu_rows.py --smoke                         # the whole script on the CPU, tiny shapes
    python benchmarks/gpu_rows.py --merge A.json B.json           # several calls' reports into benchmarks/results

On the device tool's GPU machine (its image lacks TRL, datasets, torchao: `make gpu-carry` puts their wheels in
.whl/ and the SmolLM2 GGUF's halves in .gguf/, all git-ignored). Call 1, carry [".whl", ".gguf/a"], timeout_s 480:

    set -o pipefail; python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site || exit; cp .gguf/a /root/gguf.a; \
    nvidia-smi --query-gpu=name,memory.total --format=csv; PYTHONUNBUFFERED=1 python3 benchmarks/gpu_rows.py \
      --out $OUT 2>&1 | tee $OUT/log1.txt

Call 2 at once (the machine stays warm `30 s`; part a waits in /root), carry [".whl", ".gguf/b", ".gguf/sha256"],
timeout_s 300: the held-out phase alone (`--lengths '' --scale '' --no-tests --gguf ...`), its report then merged
here with `--merge call1/gpu_rows.json call2/gpu_rows.json`:

    set -o pipefail; export PYTHONPATH=/tmp/site; test -f /root/gguf.a || { echo "part a gone (machine not warm)";
    exit 3; }; g=/tmp/SmolLM2-135M-Instruct.Q4_1.gguf; cat /root/gguf.a .gguf/b > $g && echo "$(cat .gguf/sha256)  $g"
    | sha256sum -c - || exit 4; PYTHONUNBUFFERED=1 python3 benchmarks/gpu_rows.py --lengths '' --scale '' --no-tests
      --gguf $g --out $OUT 2>&1 | tee $OUT/log2.txt

Writes benchmarks/results/gpu_rows.{json,md} (on CUDA only) and, with --out, copies there. Not a test.
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import platform
import resource
import statistics
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.gpu_rows_report import markdown, targets  # noqa: E402

REASONING = "configs/examples/smollm2_reasoning.yaml"
SHAPES: dict[str, dict[str, Any]] = {  # transformers config arguments (random weights)
    "smollm2-135m": dict(kind="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536,
                         num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, rope_theta=100000.0,
                         tie_word_embeddings=True, max_position_embeddings=8192),
    "qwen2.5-0.5b": dict(kind="qwen2", vocab_size=151936, hidden_size=896, intermediate_size=4864,
                         num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2, rope_theta=1e6,
                         tie_word_embeddings=True, max_position_embeddings=32768),
    "qwen2.5-1.5b": dict(kind="qwen2", vocab_size=151936, hidden_size=1536, intermediate_size=8960,
                         num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2, rope_theta=1e6,
                         tie_word_embeddings=True, max_position_embeddings=32768),
    "tiny": dict(kind="llama", vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True, max_position_embeddings=512),
}
MODES = {"lora": [], "full": ["grpo.lora.enabled=false", "grpo.learning_rate=0.00001"],
         "lora-nf4": ["grpo.lora.quantize_base=nf4"]}


# ------------------------------------------------------------------------------------------------ set-up
def random_model(shape: str, dtype, device, seed: int = 0):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    spec = dict(SHAPES[shape])
    kind = spec.pop("kind")
    config = (LlamaConfig if kind == "llama" else Qwen2Config)(**spec)
    torch.manual_seed(seed)
    cls = LlamaForCausalLM if kind == "llama" else Qwen2ForCausalLM
    with torch.device(device):  # initialised where it runs (a 1.5B model's init on the host takes seconds)
        return cls(config).to(dtype=dtype)


def word_tokenizer(vocab: int):
    """A tokenizer whose words "w0" .. are token ids 0 ..: prompt texts TRL tokenises into the ids ours samples
    from (random weights need no real vocabulary)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = {f"w{i}": i for i in range(vocab - 2)} | {"<pad>": vocab - 2, "<eos>": vocab - 1}
    backend = Tokenizer(models.WordLevel(vocab=words, unk_token="<pad>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", eos_token="<eos>",
                                   padding_side="left")


def grpo_config(mode: str, length: int, extra: list[str] = ()):
    from pipelines.params_io import merged_config

    return merged_config(ROOT / "params.yaml", [ROOT / REASONING],
                         [*MODES[mode], f"grpo.max_completion_length={length}", "grpo.prompts_per_step=8",
                          "grpo.group_size=8", *extra]).grpo


class Clock:
    def __init__(self, device):
        import torch

        self.cuda = device.type == "cuda"
        self.sync = torch.cuda.synchronize if self.cuda else (lambda: None)

    def __call__(self) -> float:
        self.sync()
        return time.perf_counter()


def peak_gb(reset: bool = False) -> float | None:
    import torch

    if not torch.cuda.is_available():
        return None
    peak = torch.cuda.max_memory_allocated() / 2**30
    if reset:
        torch.cuda.reset_peak_memory_stats()
    return peak


# --------------------------------------------------------------------------------------------- ours
class Ours:
    """This pipeline's engine through its door (`build_engine`), its update (`policy_updates`) and optimizer
    (`make_optimizer`: float32 masters for bf16 full fine-tuning), on a model it is handed."""

    def __init__(self, model, g, vocab: int, prompt_tokens: int, device, engine_mode: str | None, say=print):
        import torch

        from components.engine.grpo.memory_estimate import fit_memory
        from components.engine.grpo.objectives import build_loss
        from components.engine.grpo.policy import Policy
        from components.engine.models.optim import make_optimizer
        from components.engine.rollout.base import SpecialTokens
        from components.engine.rollout.choose import EngineSettings, build_engine
        from components.engine.rollout.cuda_graphs import CudaGraphEngine

        self.g, self.loss, self.device = g, build_loss(g), device
        if g.lora.enabled:
            from components.engine.grpo.policy import attach_lora

            model = attach_lora(model, g.lora)
        reference = None
        if self.loss.uses_reference and not g.lora.enabled:
            reference = copy.deepcopy(model).eval().requires_grad_(False)
        fit = fit_memory(g, model, prompt_tokens, reference is not None, say)
        self.checkpointing = fit.gradient_checkpointing
        self.tokens = SpecialTokens(eos_id=vocab - 1, pad_id=vocab - 2)
        settings = EngineSettings(cuda_graphs=g.cuda_graphs, gradient_checkpointing=fit.gradient_checkpointing,
                                  vocab_size=vocab, max_length=prompt_tokens + g.max_completion_length,
                                  completion_length=g.max_completion_length)
        engine = build_engine(model.train(), self.tokens, settings, say)
        if engine_mode and engine.name == "prefix_shared":  # --smoke on the CPU: the graph engine's fused loop
            engine = CudaGraphEngine(engine, engine_mode, settings.max_length, say=say)
        self.engine_name = engine.name
        self.policy = Policy.of(None, model, engine, reference, g.lora.enabled, self.loss.uses_reference)
        self.optimizer = make_optimizer(model, g.learning_rate, g.weight_decay, device)
        self.generator = torch.Generator(device=device).manual_seed(1)
        self.clock = Clock(device)

    def step(self, prompts: list[list[int]]) -> dict[str, float]:
        import torch

        from components.engine.grpo.trajectory import Trajectory
        from components.engine.grpo.update import UpdatePlan, policy_updates, reference_logprobs
        from components.engine.rollout.base import SamplingParams

        g, policy = self.g, self.policy
        params = SamplingParams(n=g.group_size, max_new_tokens=g.max_completion_length, temperature=g.temperature,
                                top_p=g.top_p, top_k=g.top_k, ignore_eos=True)
        peak_gb(reset=True)
        t0 = self.clock()
        rollouts = policy.engine.sample(prompts, params, self.generator)
        t1 = self.clock()
        advantages = torch.randn(len(rollouts), generator=self.generator, device=self.device)
        plan = UpdatePlan.of(len(rollouts), rollouts.group_size, g)
        ref = reference_logprobs(policy, rollouts, plan, g.temperature) if self.loss.uses_reference else None
        t2 = self.clock()
        policy_updates(policy, self.optimizer, Trajectory(rollouts, advantages, rollouts.completion_mask.float(),
                                                          torch.ones(len(rollouts), dtype=torch.bool,
                                                                     device=self.device), ref), g, self.loss, plan)
        t3 = self.clock()
        return {"generation_s": t1 - t0, "reference_s": t2 - t1, "update_s": t3 - t2, "step_s": t3 - t0,
                "tokens": int(rollouts.completion_mask.sum()), "peak_gb": peak_gb()}


def random_prompts(count: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    import torch

    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab - 2, (count, length), generator=gen).tolist()


def median_of(steps: list[dict[str, float]], key: str) -> float:
    timed = steps[1:] or steps  # the first step warms kernels, captures and the allocator up
    return statistics.median(s[key] for s in timed)


def summary(steps: list[dict[str, float]]) -> dict[str, Any]:
    tokens = median_of(steps, "tokens")
    out = {k: round(median_of(steps, k), 4) for k in ("generation_s", "reference_s", "update_s", "step_s")}
    out.update(tokens=tokens, completion_tokens_per_s=round(tokens / out["step_s"], 1),
               generation_tokens_per_s=round(tokens / out["generation_s"], 1),
               peak_gpu_gb=max((s["peak_gb"] or 0) for s in steps) or None, timed_steps=len(steps[1:] or steps))
    return out


# ------------------------------------------------------------------------------------------------ TRL
def trl_alternating(args, model_ours, model_trl, tokenizer, g, prompts_text: list[str], prompt_ids, say):
    """TRL's GRPOTrainer for `args.rounds` steps; after each of its steps one step of ours (timed apart): the two
    take turns on the same card. Returns ({engine: summary}, trl_version)."""
    import torch
    import trl
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    device = torch.device(args.device)
    ours = Ours(model_ours, g, len(tokenizer), len(prompt_ids[0]), device, args.engine_mode, say)
    clock, timers = Clock(device), {"generation": 0.0}
    steps: dict[str, list[dict[str, float]]] = {"ours": [], "trl": []}
    settings = dict(output_dir=str(Path(args.work) / "trl-out"), use_cpu=device.type == "cpu",
                    bf16=device.type == "cuda", fp16=False, gradient_checkpointing=False,
                    per_device_train_batch_size=g.prompts_per_step * g.group_size, num_generations=g.group_size,
                    max_completion_length=g.max_completion_length, temperature=g.temperature, top_p=g.top_p, top_k=0,
                    beta=g.kl_beta, learning_rate=g.learning_rate, loss_type=g.loss_type, max_steps=args.rounds,
                    report_to="none", save_strategy="no", logging_steps=1000, disable_tqdm=True, seed=1,
                    dataloader_num_workers=0, generation_kwargs={"min_new_tokens": g.max_completion_length})
    peft_config = None
    if g.lora.enabled:
        from peft import LoraConfig

        peft_config = LoraConfig(r=g.lora.rank, lora_alpha=g.lora.alpha, lora_dropout=g.lora.dropout,
                                 target_modules=list(g.lora.target_modules), task_type="CAUSAL_LM")

    def reward(completions, **_):
        return [0.0] * len(completions)  # speed rows: the update runs whatever the advantages

    trainer = GRPOTrainer(model=model_trl, reward_funcs=reward, args=GRPOConfig(**settings),
                          train_dataset=Dataset.from_list([{"prompt": p} for p in prompts_text * args.rounds]),
                          processing_class=tokenizer, peft_config=peft_config)
    generate = trainer._generate

    def timed_generate(*a, **kw):
        t0 = clock()
        try:
            return generate(*a, **kw)
        finally:
            timers["generation"] += clock() - t0

    trainer._generate = timed_generate
    state = {"start": 0.0}

    class Turns(TrainerCallback):
        def on_step_begin(self, *_a, **_k):
            timers["generation"] = 0.0
            peak_gb(reset=True)
            state["start"] = clock()

        def on_step_end(self, *_a, **_k):
            seconds = clock() - state["start"]
            tokens = g.prompts_per_step * g.group_size * g.max_completion_length
            steps["trl"].append({"generation_s": timers["generation"], "reference_s": 0.0,
                                 "update_s": seconds - timers["generation"], "step_s": seconds, "tokens": tokens,
                                 "peak_gb": peak_gb()})
            steps["ours"].append(ours.step(prompt_ids))
            say(f"  round {len(steps['trl'])}/{args.rounds}: TRL {tokens / seconds:,.0f} tokens/s, ours "
                f"{steps['ours'][-1]['tokens'] / steps['ours'][-1]['step_s']:,.0f} tokens/s", flush=True)

    trainer.add_callback(Turns())
    trainer.train()
    return {"ours": {**summary(steps["ours"]), "engine": ours.engine_name,
                     "mode": getattr(ours.policy.engine, "mode", None), "gradient_checkpointing": ours.checkpointing},
            "trl": summary(steps["trl"])}, trl.__version__


def long_row(args, mode: str, length: int, say) -> dict[str, Any]:
    import torch

    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    shape = args.long_shape
    vocab = SHAPES[shape]["vocab_size"]
    tokenizer = word_tokenizer(vocab)
    g = grpo_config(mode, length)
    ids = random_prompts(g.prompts_per_step, args.prompt_tokens, vocab, seed=length)
    texts = [" ".join(f"w{t}" for t in p) for p in ids]
    assert tokenizer(texts[0], add_special_tokens=False).input_ids == ids[0]
    model_ours = random_model(shape, dtype, device)
    model_trl = random_model(shape, dtype, device)
    parameters = sum(p.numel() for p in model_ours.parameters())
    engines, version = trl_alternating(args, model_ours, model_trl, tokenizer, g, texts, ids, say)
    del model_ours, model_trl
    row = {"row": "long", "shape": shape, "mode": mode, "length": length, "parameters": parameters,
           "rows": g.prompts_per_step * g.group_size, "prompt_tokens": args.prompt_tokens, "trl_version": version,
           "engines": engines,
           "speedup_vs_trl": round(engines["ours"]["completion_tokens_per_s"]
                                   / engines["trl"]["completion_tokens_per_s"], 2),
           "generation_speedup_vs_trl": round(engines["ours"]["generation_tokens_per_s"]
                                              / engines["trl"]["generation_tokens_per_s"], 2)}
    return {**row, **limits(args, row, SHAPES[shape], g, engines["ours"])}


# --------------------------------------------------------------------------------------- the card's limits
def ceilings(device) -> dict[str, float]:
    """The card's copy bandwidth (bytes read + written) and bf16 matrix rate, measured here (METHOD.md)."""
    import torch

    if device.type != "cuda":
        return {"bandwidth_gbs": 20.0, "bf16_tflops": 0.1, "measured": False}  # --smoke: placeholders
    clock = Clock(device)
    src = torch.randn(2**28, device=device)  # 1 GiB
    dst = torch.empty_like(src)
    times = []
    for _ in range(6):
        t0 = clock()
        dst.copy_(src)
        times.append(clock() - t0)
    bandwidth = 2 * src.numel() * 4 / statistics.median(times[1:])
    a, b = (torch.randn(8192, 8192, device=device, dtype=torch.bfloat16) for _ in range(2))
    times = []
    for _ in range(6):
        t0 = clock()
        a @ b
        times.append(clock() - t0)
    rate = 2 * 8192**3 / statistics.median(times[1:])
    del src, dst, a, b
    torch.cuda.empty_cache()
    return {"bandwidth_gbs": round(bandwidth / 1e9), "bf16_tflops": round(rate / 1e12), "measured": True}


def limits(args, row: dict[str, Any], spec: dict[str, Any], g, ours: dict[str, Any]) -> dict[str, Any]:
    """How far a row is from the card: decoding against bandwidth, the update against the bf16 matrix rate."""
    n, rows, length, prompt = row["parameters"], row["rows"], row["length"], row["prompt_tokens"]
    head_dim = spec["hidden_size"] // spec["num_attention_heads"]
    kv_per_token = spec["num_hidden_layers"] * 2 * spec["num_key_value_heads"] * head_dim * 2  # bf16 keys + values
    step_bytes = 2 * n + rows * kv_per_token * (prompt + length / 2)  # weights once + the average cache read
    floor_generation = length * step_bytes / (args.ceiling["bandwidth_gbs"] * 1e9)
    fed = rows * length + g.prompts_per_step * prompt  # each prompt once, every completion token
    per_token = (4 if row["mode"].startswith("lora") else 6) + (2 if ours.get("gradient_checkpointing") else 0)
    update_flops = per_token * n * fed
    peak = args.ceiling["bf16_tflops"] * 1e12
    out = {"decode_step_mb": round(step_bytes / 2**20, 1),
           "generation_floor_s": round(floor_generation, 4),
           "generation_share_of_bandwidth": round(floor_generation / ours["generation_s"], 3),
           "update_tflops": round(update_flops / ours["update_s"] / 1e12, 1),
           "update_mfu": round(update_flops / ours["update_s"] / peak, 3)}
    if ours.get("reference_s"):
        out["reference_mfu"] = round(2 * n * fed / ours["reference_s"] / peak, 3)
    return out


# --------------------------------------------------------------------------------------------- scale rows
def scale_row(args, shape: str, mode: str, say) -> dict[str, Any]:
    import torch

    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    vocab = SHAPES[shape]["vocab_size"]
    g = grpo_config(mode, args.scale_length, ["grpo.kl_beta=0.04"])
    model = random_model(shape, dtype, device)
    parameters = sum(p.numel() for p in model.parameters())
    ids = random_prompts(g.prompts_per_step, args.prompt_tokens, vocab, seed=7)
    ours = Ours(model, g, vocab, args.prompt_tokens, device, args.engine_mode, say)
    steps = []
    for i in range(args.scale_steps):
        steps.append(ours.step(ids))
        say(f"  step {i + 1}/{args.scale_steps}: {steps[-1]['tokens'] / steps[-1]['step_s']:,.0f} tokens/s", flush=True)
    result = {**summary(steps), "engine": ours.engine_name, "mode": getattr(ours.policy.engine, "mode", None),
              "gradient_checkpointing": ours.checkpointing}
    for phase in ("reference", "update"):
        result[f"{phase}_tokens_per_s"] = round(result["tokens"] / result[f"{phase}_s"], 1) if result[f"{phase}_s"] \
            else None
    row = {"row": "scale", "shape": shape, "mode": mode, "length": args.scale_length, "parameters": parameters,
           "rows": g.prompts_per_step * g.group_size, "prompt_tokens": args.prompt_tokens, "ours": result}
    del ours, model
    return {**row, **limits(args, row, SHAPES[shape], g, result)}


def compile_option(args, say) -> dict[str, Any]:
    """Generation alone on the long row's shape, the graphs with and without the Inductor-compiled step."""
    import torch

    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    vocab = SHAPES[args.long_shape]["vocab_size"]
    g = grpo_config("lora", args.scale_length)
    ids = random_prompts(g.prompts_per_step, args.prompt_tokens, vocab, seed=3)
    out: dict[str, Any] = {"row": "compile_step", "shape": args.long_shape, "length": args.scale_length}
    for compiled in (False, True):
        ours = Ours(random_model(args.long_shape, dtype, device), g, vocab, args.prompt_tokens, device,
                    args.engine_mode, say)
        ours.policy.engine.compile_step = compiled
        t0 = time.perf_counter()
        steps = [ours.step(ids) for _ in range(2)]
        out["compiled" if compiled else "graphs"] = {"generation_tokens_per_s": round(
            steps[1]["tokens"] / steps[1]["generation_s"], 1), "first_step_s": round(steps[0]["step_s"], 1),
            "seconds": round(time.perf_counter() - t0, 1), "engine": ours.engine_name,
            "mode": getattr(ours.policy.engine, "mode", None)}  # token_loop: a capture failed (its line says why)
        del ours
    return out


# ------------------------------------------------------------------------------------------- the run
def card(device) -> dict[str, Any]:
    import torch
    import transformers

    info = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
            "transformers": transformers.__version__}
    try:
        import trl

        info["trl"] = trl.__version__
    except ImportError:
        info["trl"] = None
    info["device"] = torch.cuda.get_device_name() if device.type == "cuda" else f"CPU ({platform.machine()})"
    if device.type == "cuda":
        info["gpu_memory_gb"] = round(torch.cuda.get_device_properties(device).total_memory / 2**30, 1)
    return info


def gpu_tests(args) -> dict[str, Any]:
    """`pytest -m gpu` (skipped without CUDA), its closing line and exit status."""
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider",
                           "tests/engine/rollout/test_cuda_graphs.py"], cwd=ROOT, capture_output=True, text=True,
                          timeout=args.tests_timeout)
    lines = [line for line in proc.stdout.splitlines() if line.strip()]
    return {"exit": proc.returncode, "summary": lines[-1] if lines else proc.stderr[-300:],
            "failures": [line for line in lines if line.startswith("FAILED")][:10]}


def phases(args) -> list[tuple[str, Callable[[Callable], dict[str, Any]]]]:
    todo: list[tuple[str, Callable]] = []
    for length in [int(x) for x in args.lengths.split(",") if x]:
        for mode in args.modes.split(","):
            todo.append((f"long {mode} {length}", lambda say, m=mode, n=length: long_row(args, m, n, say)))
    for mode in args.scale_modes.split(","):
        for shape in [s for s in args.scale.split(",") if s]:
            todo.append((f"scale {shape} {mode}", lambda say, s=shape, m=mode: scale_row(args, s, m, say)))
    if args.compile_option:
        todo.append(("compile_step option", lambda say: compile_option(args, say)))
    if args.gguf:
        from benchmarks.gpu_rows_heldout import heldout_row

        for mode in args.heldout_modes.split(","):
            extra = ["grpo.lora.quantize_base=nf4"] if mode == "lora-nf4" else []
            todo.append((f"held-out after equal completions, {mode}",
                         lambda say, e=extra, m=mode: heldout_row(args, say, e, with_trl=m != "lora-nf4")))
    return todo


def run(args) -> dict[str, Any]:
    import torch

    started = time.perf_counter()
    device = torch.device(args.device)
    report: dict[str, Any] = {"command": "python benchmarks/gpu_rows.py " + " ".join(sys.argv[1:]),
                              "card": card(device), "rows": [], "skipped": []}
    args.ceiling = report["ceiling"] = ceilings(device)
    print(f"{report['card']}; ceilings {report['ceiling']}", flush=True)
    if args.tests:
        report["gpu_tests"] = gpu_tests(args)
        print(f"gpu tests: {report['gpu_tests']['summary']}", flush=True)
    save(args, report)
    for name, measure in phases(args):
        elapsed = time.perf_counter() - started
        if elapsed > args.budget_s:
            report["skipped"].append(f"{name}: over the {args.budget_s:.0f} s budget")
            continue
        print(f"[{elapsed:.0f} s] {name} ...", flush=True)
        try:
            report["rows"].append({**measure(print), "seconds": round(time.perf_counter() - started - elapsed, 1),
                                   "process_peak_rss_gb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
                                                                / 2**20, 2)})  # host memory, so far in the run
        except Exception as err:  # noqa: BLE001 - one failing row must not lose the others' figures
            traceback.print_exc()
            report["rows"].append({"row": name, "error": f"{type(err).__name__}: {str(err)[:300]}"})
        gc.collect()  # a trainer's reference cycles would keep the last row's model and graphs on the card
        if device.type == "cuda":
            torch.cuda.empty_cache()
        report["targets"] = targets(report)
        save(args, report)
    report["seconds"] = round(time.perf_counter() - started, 1)
    save(args, report)
    return report


def _identity(row: dict[str, Any]) -> tuple:
    return tuple(row.get(k) for k in ("row", "shape", "mode", "length"))


def merged(args, report: dict[str, Any]) -> dict[str, Any]:
    """With --update, the rows of the report already in benchmarks/results that this run did not measure, kept."""
    path = ROOT / "benchmarks" / "results" / "gpu_rows.json"
    if not args.update or not path.exists():
        return report
    return merge_reports(json.loads(path.read_text()), report)


def merge_reports(previous: dict[str, Any], report: dict[str, Any]) -> dict[str, Any]:
    """`report` over `previous`: its rows replace theirs of the same row, shape, mode and length; the rest stay."""
    measured = {_identity(r) for r in report["rows"]}
    rows = [r for r in previous.get("rows", []) if _identity(r) not in measured] + report["rows"]
    out = {**report, "rows": rows, "gpu_tests": report.get("gpu_tests") or previous.get("gpu_tests"),
           "commands": previous.get("commands", [previous.get("command")]) + [report["command"]]}
    out["targets"] = targets(out)
    return out


def save(args, report: dict[str, Any]) -> None:
    report = merged(args, report)
    text = markdown(report)
    # benchmarks/results holds GPU runs only: a CPU run (--smoke, a check) writes to --out alone
    folders = (([ROOT / "benchmarks" / "results"] if args.device == "cuda" else [])
               + ([Path(args.out)] if args.out else []))
    for folder in folders:
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "gpu_rows.json").write_text(json.dumps(report, indent=1) + "\n")
        (folder / "gpu_rows.md").write_text(text)


def arguments(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--lengths", default="128,512", help="the long row's completion lengths")
    parser.add_argument("--modes", default="lora,full")
    parser.add_argument("--long-shape", default="smollm2-135m", choices=list(SHAPES))
    parser.add_argument("--scale", default="qwen2.5-0.5b,qwen2.5-1.5b", help="the scale rows' shapes ('' for none)")
    parser.add_argument("--scale-length", type=int, default=512)
    parser.add_argument("--scale-steps", type=int, default=2, help="steps a scale row (the first not timed)")
    parser.add_argument("--prompt-tokens", type=int, default=96, help="tokens of each (random) prompt")
    parser.add_argument("--rounds", type=int, default=2, help="turns of TRL and ours a long row (the first a warm-up)")
    parser.add_argument("--compile-option", action="store_true", help="also measure compile_step (compiles: slow)")
    parser.add_argument("--gguf", help="SmolLM2-135M-Instruct GGUF: also held-out after equal completions")
    parser.add_argument("--heldout-steps", type=int, default=6)
    parser.add_argument("--heldout", type=int, default=100, help="held-out prompts")
    parser.add_argument("--heldout-modes", default="lora,lora-nf4",
                        help="held-out rows: lora (against TRL), lora-nf4 (a 4-bit frozen base, ours alone)")
    parser.add_argument("--heldout-overrides", default="", help="config overrides of the held-out phase (CPU checks)")
    parser.add_argument("--scale-modes", default="lora,full,lora-nf4",
                        help="the scale rows' modes (lora-nf4: a 4-bit frozen base, torchao)")
    parser.add_argument("--no-tests", dest="tests", action="store_false")
    parser.add_argument("--tests-timeout", type=int, default=120)
    parser.add_argument("--budget-s", type=float, default=300.0, help="start no phase after this many seconds")
    parser.add_argument("--engine-mode", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--work", default="/tmp/gpu-rows")
    parser.add_argument("--out", help="also write gpu_rows.{json,md} here (the device tool's $OUT)")
    parser.add_argument("--update", action="store_true",
                        help="keep the rows of benchmarks/results/gpu_rows.json that this run does not measure")
    parser.add_argument("--merge", nargs="+", metavar="JSON", help="merge the reports of several calls (the first "
                        "is the base) into benchmarks/results/gpu_rows.{json,md}; measures nothing")
    parser.add_argument("--smoke", action="store_true",
                        help="the whole script on the CPU with tiny shapes (results not written to benchmarks/)")
    args = parser.parse_args(argv)
    if args.smoke:
        args.device, args.dtype, args.lengths, args.scale_length, args.prompt_tokens = "cpu", "float32", "8", 8, 6
        args.long_shape, args.scale, args.engine_mode, args.tests = "tiny", "tiny", "eager", False
    return args


def main(argv: list[str] | None = None) -> int:
    args = arguments(argv)
    if args.merge:  # reports of several calls (the held-out call after the main one) into benchmarks/results
        reports = [json.loads(Path(f).read_text()) for f in args.merge]
        report = reports[0]
        for later in reports[1:]:
            report = merge_reports(report, later)
        args.device, args.update = "cuda", False
        save(args, report)
        print(markdown(report))
        return 0
    report = run(args)
    print(markdown(report))
    return 0 if not any("error" in r for r in report["rows"]) else 1


if __name__ == "__main__":
    sys.exit(main())
