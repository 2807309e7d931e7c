"""benchmarks/gpu_rows.py's bookkeeping, on reports written by hand: each issue-55 target checked against its row,
a later call's rows merged over an earlier call's, and how far a row is from the card. (The script itself runs on
the CPU with `python benchmarks/gpu_rows.py --smoke`, about a minute: documented, not run here.)"""

from argparse import Namespace

from benchmarks.gpu_rows import SHAPES, limits, merge_reports
from benchmarks.gpu_rows_report import markdown, targets


def _long(mode: str, length: int, step: float, trl: float, generation: float) -> dict:
    ours = {"completion_tokens_per_s": step, "generation_tokens_per_s": generation, "tokens": 32768, "update_s": 1.0,
            "peak_gpu_gb": 3.0}
    return {"row": "long", "shape": "smollm2-135m", "mode": mode, "length": length, "trl_version": "1.16.0",
            "speedup_vs_trl": round(step / trl, 2), "generation_share_of_bandwidth": 0.1, "update_mfu": 0.2,
            "decode_step_mb": 788.0,
            "engines": {"ours": ours, "trl": {**ours, "completion_tokens_per_s": trl}}}


def _report(rows: list[dict], command: str = "python benchmarks/gpu_rows.py") -> dict:
    return {"command": command, "rows": rows, "ceiling": {"bandwidth_gbs": 3000, "bf16_tflops": 800},
            "card": {"device": "NVIDIA H100 80GB HBM3", "torch": "2.11.0", "cuda": "13.0", "transformers": "5.17",
                     "trl": "1.16.0"}}


def test_each_target_is_checked_against_its_row():
    full_15b = {"row": "scale", "shape": "qwen2.5-1.5b", "mode": "full", "ours": {"peak_gpu_gb": 81.5}}
    checked = {t["what"]: t["met"] for t in targets(_report([_long("lora", 512, 12_000, 3_000, 19_000), full_15b]))}
    assert checked == {"long row, lora, 512 tokens: completion tokens/s of a step": True,
                       "long row, lora, 512 tokens: times TRL": True,
                       "long row, lora, 512 tokens: generation tokens/s": False,
                       "1.5B full fine-tuning at 64 x 512: peak GPU memory (GB)": False}
    failed = {"row": "scale", "shape": "qwen2.5-1.5b", "mode": "full", "error": "OutOfMemoryError: ..."}
    assert targets(_report([failed]))[0]["met"] is False


def test_a_later_call_replaces_only_the_rows_it_measured():
    first = _report([_long("lora", 128, 11_000, 3_000, 25_000), _long("full", 128, 9_000, 3_000, 25_000)])
    second = _report([_long("full", 128, 10_500, 3_000, 25_000)], "python benchmarks/gpu_rows.py --gguf x")
    merged = merge_reports(first, second)
    assert [(r["mode"], r["engines"]["ours"]["completion_tokens_per_s"]) for r in merged["rows"]] == [
        ("lora", 11_000), ("full", 10_500)]
    assert merged["commands"] == ["python benchmarks/gpu_rows.py", "python benchmarks/gpu_rows.py --gguf x"]
    assert "--gguf x" in markdown(merged) and "NVIDIA H100" in markdown(merged)


def test_distance_from_the_card_counts_weights_cache_and_model_flops():
    args = Namespace(ceiling={"bandwidth_gbs": 1000, "bf16_tflops": 100})
    row = {"parameters": 1_000_000_000, "rows": 64, "length": 100, "prompt_tokens": 50, "mode": "full"}
    spec = SHAPES["qwen2.5-1.5b"]  # 28 layers, 2 key/value heads of 128: 28,672 bytes of cache a token
    g = Namespace(prompts_per_step=8)
    out = limits(args, row, spec, g, {"generation_s": 1.0, "update_s": 2.0, "reference_s": 0.0})
    step_bytes = 2e9 + 64 * 28 * 2 * 2 * 128 * 2 * (50 + 50)
    assert out["generation_floor_s"] == round(100 * step_bytes / 1e12, 4)
    fed = 64 * 100 + 8 * 50
    assert out["update_mfu"] == round(6 * 1e9 * fed / 2.0 / 1e14, 3)
