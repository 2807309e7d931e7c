"""The GPU plan: one call on a GPU machine that first proves the captured engine is the one being timed, then measures
this pipeline against TRL on the same card, most important rows first.

In order (each result saved as soon as it exists; no phase starts whose estimate would end past `--budget-s`):
  0. torchao imported first thing (the 4-bit rows need it: a broken install shows in the first second, exit 2);
     the grpo stage's determinism setting (`seed_everything`), so rows take the kernels the stage takes; the GPU-only
     tests (`pytest -m gpu`) start in the background;
  1. the gate (gpu_rows_gate.py): the door gives the CUDA-graph engine in graph mode for SmolLM2's
     shape in bfloat16, captured and eager greedy tokens agree over 32 steps, a sampled run's sampler-vs-trainer
     log-prob gap is under `MAX_GAP` nats on average; prints the attention kernel, graphs captured and capture time.
     Failing, it exits 3 (after trying once more without the determinism setting, to say whether that is the cause):
     timing the fallback and calling it the captured engine is worse than no figure;
  2. the long rows at 128 tokens (SmolLM2's shape, LoRA and full, 64 completions a step, ours and TRL taking turns:
     gpu_rows_trl.py), the rows the targets read;
  3. the scale rows: random Qwen2.5-1.5B and -0.5B shapes (benchmarks/shapes.py), full, LoRA and LoRA over a 4-bit
     base, 64 x 512 tokens, KL term on; ours alone; then a 256-row row (32 prompts x 8) against TRL and an EOS-on row
     (ours, rows stop at EOS: random weights never choose it, so this times the host's checks for finished rows);
  4. the long rows at 512 tokens against TRL; with `--compile-option`, the Inductor-compiled step.
With `--gguf` (the second call): rows on the real SmolLM2-135M-Instruct from its SFT warm start (256 rows, and EOS on
at 512 tokens, ours against TRL), then held-out reward after equal completions (gpu_rows_heldout.py).

Every row says how far it is from the card: decoding against memory bandwidth (bytes a decode step must read:
the weights once, plus each row's cached keys and values), the update against the bf16 matrix rate (MFU, model
FLOPs: 2N a token forward, 4N forward + backward with LoRA, 6N full; HFU also counts the 2N gradient checkpointing
computes again). Targets
(issue 55), the constants of benchmarks/gpu_rows_report.py: the long row's whole step at `LONG_STEP_TOKENS_S`
completion tokens/s and `LONG_VS_TRL` times TRL; 135M generation at 64 rows at `GENERATION_TOKENS_S` tokens/s; 1.5B
full fine-tuning at 64 x 512 within one card of `FULL_1_5B_GB`.

Every row records the on-policy gap (ours: the sampler's log-probs against the update's own), completion tokens
(TRL's counted from its completion mask), peak allocated and reserved GPU memory, and TRL's baseline by name.

    python benchmarks/gpu_rows.py --out $OUT            # the plan, on the GPU machine (tracking off, no MLflow)
    python benchmarks/gpu_rows.py --smoke --out DIR     # the whole plan on the CPU, tiny shapes (a test runs it)
    python benchmarks/gpu_rows.py --merge A.json B.json # several calls' reports into benchmarks/results

The device tool's calls (its image lacks TRL, datasets, torchao and gguf; `make gpu-carry` puts their wheels in .whl/
and the SmolLM2 GGUF's two halves in .gguf/, all git-ignored; the GGUF cannot travel in one call's `64 MiB`):
docs/performance.md ("The device plan") gives the exact `command` and `carry` of each.

Writes benchmarks/results/gpu_rows.{json,md} (on CUDA only) and, with --out, copies there. Exit status: 0 when the
gate, the GPU tests and every row passed; 2 torchao missing, 3 the gate failed, 1 anything else.
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import re
import resource
import shlex
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.gpu_rows_ours import Ours, grpo_config, limits, random_prompts, summary, word_tokenizer  # noqa: E402
from benchmarks.gpu_rows_report import markdown, targets  # noqa: E402
from benchmarks.shapes import SHAPES, random_model  # noqa: E402


@dataclass(frozen=True)
class Phase:
    name: str
    estimate_s: float  # on an H100/H200, for the budget (a guess until a run says otherwise)
    measure: Callable[[Callable[..., None]], dict[str, Any]]


# ------------------------------------------------------------------------------------------------ rows
def trl_row(args, kind: str, mode: str, length: int, prompts: int = 8, group: int = 8, say=print) -> dict[str, Any]:
    """Ours and TRL taking turns on random weights of `args.long_shape`, every completion at the budget."""
    import torch

    from benchmarks.gpu_rows_trl import trl_alternating

    device, dtype, shape = torch.device(args.device), getattr(torch, args.dtype), args.long_shape
    vocab = SHAPES[shape]["vocab_size"]
    tokenizer = word_tokenizer(vocab)
    cfg = grpo_config(mode, length, prompts=prompts, group=group)
    ids = random_prompts(prompts, args.prompt_tokens, vocab, seed=length + prompts)
    texts = [" ".join(f"w{t}" for t in p) for p in ids]
    assert tokenizer(texts[0], add_special_tokens=False).input_ids == ids[0]
    model_ours, model_trl = random_model(shape, dtype, device), random_model(shape, dtype, device)
    parameters = sum(p.numel() for p in model_ours.parameters())
    engines = trl_alternating(args, cfg, model_ours, model_trl, tokenizer, texts, ids, say)
    del model_ours, model_trl
    ours, trl = engines["ours"], engines["trl"]
    row = {"row": kind, "shape": shape, "mode": mode, "length": length, "parameters": parameters,
           "rows": prompts * group, "prompt_tokens": args.prompt_tokens, "trl_baseline": engines["trl_baseline"],
           "engines": {"ours": ours, "trl": trl},
           "speedup_vs_trl": round(ours["completion_tokens_per_s"] / trl["completion_tokens_per_s"], 2),
           "generation_speedup_vs_trl": round(ours["generation_tokens_per_s"] / trl["generation_tokens_per_s"], 2)}
    return {**row, **limits(args.ceiling, row, SHAPES[shape], prompts, ours, cfg.grpo.kl_beta > 0)}


def ours_row(args, kind: str, shape: str, mode: str, length: int, kl: bool, ignore_eos: bool = True,
             say=print) -> dict[str, Any]:
    """Ours alone on random weights of `shape`, `args.scale_steps` steps (the first not timed)."""
    import torch

    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    vocab = SHAPES[shape]["vocab_size"]
    cfg = grpo_config(mode, length, ["grpo.kl_beta=0.04"] if kl else [])
    model = random_model(shape, dtype, device)
    parameters = sum(p.numel() for p in model.parameters())
    ids = random_prompts(cfg.grpo.prompts_per_step, args.prompt_tokens, vocab, seed=7)
    ours = Ours(model, cfg, vocab, args.prompt_tokens, device, args.engine_mode, say=say)
    steps = []
    for i in range(args.scale_steps):
        steps.append(ours.step(ids, ignore_eos=ignore_eos))
        say(f"  step {i + 1}/{args.scale_steps}: {steps[-1]['tokens'] / steps[-1]['step_s']:,.0f} tokens/s", flush=True)
    result = {**summary(steps), "engine": ours.engine_name, "mode": ours.mode,
              "gradient_checkpointing": ours.checkpointing, "nf4_weights": ours.quantized or None}
    for phase in ("reference", "update"):  # no reference figure on a row that ran none
        seconds = result[f"{phase}_s"] if phase == "update" or kl else None
        result[f"{phase}_tokens_per_s"] = round(result["tokens"] / seconds, 1) if seconds else None
    row = {"row": kind, "shape": shape, "mode": mode, "length": length, "parameters": parameters,
           "rows": cfg.grpo.prompts_per_step * cfg.grpo.group_size, "prompt_tokens": args.prompt_tokens,
           "kl": kl, "eos": not ignore_eos, "ours": result}
    del ours, model
    return {**row, **limits(args.ceiling, row, SHAPES[shape], cfg.grpo.prompts_per_step, result, kl)}


def compile_option(args, say) -> dict[str, Any]:
    """Generation alone on the long row's shape, the graphs with and without the Inductor-compiled step."""
    import torch

    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    vocab = SHAPES[args.long_shape]["vocab_size"]
    cfg = grpo_config("lora", args.scale_length)
    ids = random_prompts(cfg.grpo.prompts_per_step, args.prompt_tokens, vocab, seed=3)
    out: dict[str, Any] = {"row": "compile_step", "shape": args.long_shape, "length": args.scale_length}
    for compiled in (False, True):
        ours = Ours(random_model(args.long_shape, dtype, device), cfg, vocab, args.prompt_tokens, device,
                    args.engine_mode, say=say)
        ours.policy.engine.compile_step = compiled
        t0 = time.perf_counter()
        steps = [ours.step(ids) for _ in range(2)]
        out["compiled" if compiled else "graphs"] = {"generation_tokens_per_s": round(
            steps[1]["tokens"] / steps[1]["generation_s"], 1), "first_step_s": round(steps[0]["step_s"], 1),
            "seconds": round(time.perf_counter() - t0, 1), "engine": ours.engine_name, "mode": ours.mode}
        del ours
    return out


def scale_order(args) -> list[tuple[str, str]]:
    """(shape, mode) of the scale rows, the 1.5B full row first (a target), then by what a team asks first."""
    shapes, modes = [s for s in args.scale.split(",") if s], args.scale_modes.split(",")
    wanted = [(shape, mode) for shape in shapes for mode in modes]
    first = [("qwen2.5-1.5b", "full"), ("qwen2.5-0.5b", "lora"), ("qwen2.5-0.5b", "full"), ("qwen2.5-1.5b", "lora")]
    return [p for p in first if p in wanted] + [p for p in wanted if p not in first]


def phases(args) -> list[Phase]:
    """The plan, most important first: the 128-token long rows (the targets), the scale rows, the 256-row and
    EOS-on rows, then the 512-token long rows. Estimates are seconds on an H100/H200 (set-up and warm-ups included)."""
    todo: list[Phase] = []
    lengths = [int(x) for x in args.lengths.split(",") if x]

    def long_rows(chosen: list[int]) -> list[Phase]:
        return [Phase(f"long {mode} {length}", 15 + 0.05 * length,
                      lambda say, m=mode, n=length: trl_row(args, "long", m, n, say=say))
                for length in chosen for mode in args.modes.split(",")]

    todo += long_rows(lengths[:1])
    for shape, mode in scale_order(args):
        estimate = (15 if mode != "lora-nf4" else 20) * (2 if "1.5b" in shape else 1)
        todo.append(Phase(f"scale {shape} {mode}", estimate,
                          lambda say, s=shape, m=mode: ours_row(args, "scale", s, m, args.scale_length, True, say=say)))
    if args.wide and not args.gguf:
        todo.append(Phase(f"wide lora 256 x {args.wide_length}", 25,
                          lambda say: trl_row(args, "wide", "lora", args.wide_length, prompts=32, say=say)))
    if args.eos_row and not args.gguf:  # with the real model (the second call) its own rows of both kinds
        todo.append(Phase(f"eos lora {args.scale_length}", 12,
                          lambda say: ours_row(args, "eos", args.long_shape, "lora", args.scale_length, False,
                                               ignore_eos=False, say=say)))
    todo += long_rows(lengths[1:])
    if args.compile_option:
        todo.append(Phase("compile_step option", 120, lambda say: compile_option(args, say)))
    if args.gguf:
        from benchmarks.gpu_rows_heldout import heldout_phases

        todo += [Phase(*p) for p in heldout_phases(args)]
    return todo


# ------------------------------------------------------------------------------------------- the run
def card(device) -> dict[str, Any]:
    import torch
    import transformers

    info = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
            "transformers": transformers.__version__}
    for name in ("trl", "torchao", "peft"):
        try:
            info[name] = __import__(name).__version__
        except ImportError:
            info[name] = None
    info["device"] = torch.cuda.get_device_name() if device.type == "cuda" else f"CPU ({platform.machine()})"
    if device.type == "cuda":
        info["gpu_memory_gb"] = round(torch.cuda.get_device_properties(device).total_memory / 2**30, 1)
    return info


def ceilings(device) -> dict[str, Any]:
    """The card's copy bandwidth (bytes read + written) and bf16 matrix rate, measured here (METHOD.md)."""
    import statistics

    import torch

    from benchmarks.gpu_rows_ours import Clock

    if device.type != "cuda":
        return {"bandwidth_gbs": 20.0, "bf16_tflops": 0.1, "measured": False}  # --smoke: placeholders
    clock = Clock(device)
    src = torch.randn(2**28, device=device)  # 1 GiB
    dst = torch.empty_like(src)
    a, b = (torch.randn(8192, 8192, device=device, dtype=torch.bfloat16) for _ in range(2))
    copies, products = [], []
    for _ in range(6):
        t0 = clock()
        dst.copy_(src)
        t1 = clock()
        a @ b
        copies.append(t1 - t0)
        products.append(clock() - t1)
    bandwidth = 2 * src.numel() * 4 / statistics.median(copies[1:])
    rate = 2 * 8192**3 / statistics.median(products[1:])
    del src, dst, a, b
    torch.cuda.empty_cache()
    return {"bandwidth_gbs": round(bandwidth / 1e9), "bf16_tflops": round(rate / 1e12), "measured": True}


def start_gpu_tests(args) -> subprocess.Popen | None:
    """`pytest -m gpu` in the background (it has its own CUDA context); None where it is not run."""
    if not args.tests:
        return None
    log = open(Path(args.work) / "gpu-tests.txt", "w")
    return subprocess.Popen([sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider",
                             "tests/engine/generation/engines/test_cuda_graphs.py",
                             "tests/engine/generation/engines/test_half_precision.py"],
                            cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, text=True)


def finish_gpu_tests(args, proc: subprocess.Popen | None) -> dict[str, Any] | None:
    if proc is None:
        return None
    try:
        proc.wait(timeout=args.tests_timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    text = (Path(args.work) / "gpu-tests.txt").read_text()
    lines = [line for line in text.splitlines() if line.strip()]
    return {"exit": proc.returncode, "summary": lines[-1] if lines else "(no output)",
            "failures": [line for line in lines if line.startswith(("FAILED", "ERROR"))][:10]}


def run_gate(args, report: dict[str, Any]) -> bool:
    import torch

    from benchmarks.gpu_rows_gate import gate

    try:
        report["gate"] = gate(args)
    except Exception as err:  # noqa: BLE001 - a gate that breaks has failed: say how
        traceback.print_exc()
        report["gate"] = {"passed": False, "why": f"{type(err).__name__}: {str(err)[:300]}"}
    print(f"gate: {report['gate']}", flush=True)
    if report["gate"]["passed"] or not torch.are_deterministic_algorithms_enabled():
        return report["gate"]["passed"]
    torch.use_deterministic_algorithms(False)  # is the determinism setting the cause? (one more try, said)
    try:
        report["gate_without_determinism"] = gate(args)
    except Exception as err:  # noqa: BLE001
        report["gate_without_determinism"] = {"passed": False, "why": f"{type(err).__name__}: {str(err)[:300]}"}
    finally:
        torch.use_deterministic_algorithms(True, warn_only=True)
    print(f"gate without the determinism setting: {report['gate_without_determinism']}", flush=True)
    return False


def run(args) -> dict[str, Any]:
    import torch

    from components.engine.models.modeling import seed_everything

    started = time.perf_counter()
    Path(args.work).mkdir(parents=True, exist_ok=True)
    cfg = grpo_config("lora", 128)
    seed_everything(cfg.seed, cfg.threads)  # the grpo stage's setting: deterministic kernels (warn only)
    tests = start_gpu_tests(args)
    device = torch.device(args.device)
    report: dict[str, Any] = {"command": recorded_command(sys.argv[1:]),
                              "card": card(device), "torchao_import_s": args.torchao_import_s, "rows": [],
                              "skipped": [], "deterministic": torch.are_deterministic_algorithms_enabled()}
    args.ceiling = report["ceiling"] = ceilings(device)
    print(f"{report['card']}; ceilings {report['ceiling']}", flush=True)
    if not args.no_gate and not run_gate(args, report):
        report["gpu_tests"] = finish_gpu_tests(args, tests)
        report["stopped"] = "the gate failed: no row timed (they would time a fallback)"
        return finished(args, report, started)
    save(args, report)
    report["gpu_tests"] = finish_gpu_tests(args, tests)
    print(f"gpu tests: {report['gpu_tests']}", flush=True)
    save(args, report)
    run_phases(args, report, phases(args) if not args.gate_only else [], started)
    return finished(args, report, started)


def run_phases(args, report: dict[str, Any], todo: list[Phase], started: float) -> None:
    """Each phase in turn, unless its estimate (or the longest measured phase of its kind) would end it past the
    budget; each row saved as soon as it is measured, a failing row recorded as an error."""
    import torch

    measured: dict[str, float] = {}
    for phase in todo:
        kind = phase.name.split()[0]
        elapsed = time.perf_counter() - started
        estimate = max(phase.estimate_s, measured.get(kind, 0.0)) * args.estimate_scale
        if elapsed + estimate > args.budget_s:
            report["skipped"].append(f"{phase.name}: ~{estimate:.0f} s would end past the {args.budget_s:.0f} s "
                                     f"budget at {elapsed:.0f} s")
            continue
        print(f"[{elapsed:.0f} s] {phase.name} ...", flush=True)
        try:
            row = phase.measure(print)
        except Exception as err:  # noqa: BLE001 - one failing row must not lose the others' figures
            traceback.print_exc()
            row = {"row": phase.name, "error": f"{type(err).__name__}: {str(err)[:300]}"}
        seconds = time.perf_counter() - started - elapsed
        measured[kind] = max(measured.get(kind, 0.0), seconds)
        report["rows"].append({**row, "seconds": round(seconds, 1), "process_peak_rss_gb": round(
            resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2)})  # host memory, so far in the run
        gc.collect()  # a trainer's reference cycles would keep the last row's model and graphs on the card
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        report["targets"] = targets(report)
        save(args, report)


def finished(args, report: dict[str, Any], started: float) -> dict[str, Any]:
    report["targets"] = targets(report)
    report["seconds"] = round(time.perf_counter() - started, 1)
    save(args, report)
    return report


def recorded_command(argv: list[str]) -> str:
    """This call as a shell runs it again: every argument quoted where it must be (an empty `--scale ''` too)."""
    return shlex.join(["python", "benchmarks/gpu_rows.py", *argv])


def exit_status(report: dict[str, Any]) -> int:
    """3: the gate failed; 1: a row failed, or the GPU tests did not pass (pytest's 5, no test collected, is a failure:
    the tests that claim the captured engine never ran; without CUDA they are collected and skipped, exit 0)."""
    if not report.get("gate", {"passed": True})["passed"]:
        return 3
    tests = report.get("gpu_tests")
    failed_tests = tests is not None and tests["exit"] != 0
    return 1 if failed_tests or any("error" in r for r in report["rows"]) else 0


def _identity(row: dict[str, Any]) -> tuple:
    return tuple(row.get(k) for k in ("row", "shape", "mode", "length"))


def merge_reports(previous: dict[str, Any], report: dict[str, Any]) -> dict[str, Any]:
    """`report` over `previous`: its rows replace theirs of the same row, shape, mode and length; the rest stay."""
    measured = {_identity(r) for r in report["rows"]}
    rows = [r for r in previous.get("rows", []) if _identity(r) not in measured] + report["rows"]
    out = {**previous, **report, "rows": rows,
           "commands": previous.get("commands", [previous.get("command")]) + [report["command"]]}
    for key in ("gate", "gpu_tests"):
        out[key] = report.get(key) or previous.get(key)
    out["targets"] = targets(out)
    return out


def portable(command: str) -> str:
    """A call's command as benchmarks/device/*.sh writes it: the device machine's paths as the scripts' variables."""
    return re.sub(r"--gguf \S+", '--gguf "$g"', re.sub(r"--out \S+", '--out "$OUT"', command))


def save(args, report: dict[str, Any]) -> None:
    path = ROOT / "benchmarks" / "results" / "gpu_rows.json"
    if args.update and path.exists():
        report = merge_reports(json.loads(path.read_text()), report)
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
    add = parser.add_argument
    add("--device", default="cuda")
    add("--dtype", default="bfloat16")
    add("--lengths", default="128,512", help="the long rows' completion lengths (the first before the rest)")
    add("--modes", default="lora,full")
    add("--long-shape", default="smollm2-135m", choices=list(SHAPES))
    add("--scale", default="qwen2.5-0.5b,qwen2.5-1.5b", help="the scale rows' shapes ('' for none)")
    add("--scale-modes", default="lora,full,lora-nf4", help="the scale rows' modes (lora-nf4: a 4-bit base, torchao)")
    add("--scale-length", type=int, default=512)
    add("--scale-steps", type=int, default=2, help="steps of a row of ours alone (the first not timed)")
    add("--prompt-tokens", type=int, default=96, help="tokens of each (random) prompt")
    add("--rounds", type=int, default=2, help="turns of TRL and ours a TRL row (the first a warm-up)")
    add("--wide-length", type=int, default=128, help="completion tokens of the 256-row row")
    add("--no-wide", dest="wide", action="store_false", help="no 256-row row (random weights, or real with --gguf)")
    add("--no-eos-row", dest="eos_row", action="store_false", help="no EOS-on row (random, or real with --gguf)")
    add("--trl-generation", default="auto", choices=["auto", "continuous", "generate"],
        help="TRL's generation: auto = transformers' continuous batching where it has it (5.8+), on a GPU")
    add("--compile-option", action="store_true", help="also measure compile_step (compiles: slow)")
    add("--gguf", help="SmolLM2-135M-Instruct GGUF: rows on the real model and held-out after equal completions")
    add("--heldout-steps", type=int, default=6)
    add("--heldout", type=int, default=100, help="held-out prompts")
    add("--heldout-modes", default="lora,lora-nf4", help="held-out rows: lora (against TRL), lora-nf4 (ours alone)")
    add("--heldout-overrides", default="", help="config overrides of the held-out phase (CPU checks)")
    add("--no-tests", dest="tests", action="store_false")
    add("--tests-timeout", type=int, default=100, help="seconds the GPU tests may take (they run beside the gate)")
    add("--no-gate", action="store_true", help="skip the gate (the second call: the first call's gate stands)")
    add("--gate-only", action="store_true")
    add("--budget-s", type=float, default=300.0, help="start no phase whose estimate would end after this")
    add("--estimate-scale", type=float, default=1.0, help=argparse.SUPPRESS)
    add("--engine-mode", default=None, help=argparse.SUPPRESS)
    add("--expect-mode", default=None, help=argparse.SUPPRESS)  # what the gate requires: graphs (eager in --smoke)
    add("--work", default="/tmp/gpu-rows")
    add("--out", help="also write gpu_rows.{json,md} here (the device tool's $OUT)")
    add("--update", action="store_true", help="keep the rows of benchmarks/results/gpu_rows.json not measured now")
    add("--merge", nargs="+", metavar="JSON", help="merge several calls' reports (the first is the base) into "
        "benchmarks/results/gpu_rows.{json,md}; measures nothing")
    add("--note", action="append", default=[], help="with --merge: a line the report carries under its table (what "
        "changed between the calls, say)")
    add("--smoke", action="store_true", help="the whole plan on the CPU with tiny shapes (results to --out only)")
    args = parser.parse_args(argv)
    args.torchao_import_s = None
    args.expect_mode = args.expect_mode or ("eager" if args.smoke else "graphs")
    if args.smoke:  # the CPU rehearsal's sizes, where the command line kept the default
        smoke = dict(device="cpu", dtype="float32", scale_length=8, prompt_tokens=6, lengths="8,12", long_shape="tiny",
                     scale="tiny-qwen2", wide_length=6, tests=False)
        for key, value in smoke.items():
            if getattr(args, key) == parser.get_default(key):
                setattr(args, key, value)
        args.engine_mode, args.estimate_scale = "eager", 0.0
    return args


def import_torchao(args) -> str | None:
    """torchao, first thing: None when it imports, else the line that says why (the 4-bit rows need it)."""
    t0 = time.perf_counter()
    try:
        import torchao.quantization  # noqa: F401
    except Exception as err:  # noqa: BLE001 - any failure to import means no 4-bit rows
        return f"torchao does not import ({type(err).__name__}: {err})"
    args.torchao_import_s = round(time.perf_counter() - t0, 1)
    print(f"torchao imported in {args.torchao_import_s} s", flush=True)
    return None


def main(argv: list[str] | None = None) -> int:
    args = arguments(argv)
    if args.merge:  # several calls' reports (the real-model call after the main one) into benchmarks/results
        reports = [json.loads(Path(f).read_text()) for f in args.merge]
        report = reports[0]
        for later in reports[1:]:
            report = merge_reports(report, later)
        report["notes"] = report.get("notes", []) + args.note
        report["commands"] = [portable(c) for c in report.get("commands") or [report["command"]]]
        report["command"] = report["commands"][-1]
        args.device, args.update, args.out = "cuda", False, None
        save(args, report)
        print(markdown(report))
        return 0
    problem = import_torchao(args)
    if problem and ("nf4" in args.scale_modes or "nf4" in args.heldout_modes):
        print(f"{problem}: the 4-bit rows cannot run; stopping (--scale-modes/--heldout-modes without lora-nf4 "
              "to go on without them)", flush=True)
        return 2
    report = run(args)
    print(markdown(report))
    return exit_status(report)


if __name__ == "__main__":
    sys.exit(main())
