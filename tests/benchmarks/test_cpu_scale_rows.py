"""benchmarks/cpu_scale_rows.py on a tiny shape: each engine's worker measures its steps in-process, a row's process
is ended past the memory limit and the row says so, the prompts are the SmolLM2 example's, the growth table, and the
0.5B rows' memory on paper (ours' own estimator). The timed run itself is for a quiet machine (its docstring)."""

from __future__ import annotations

import pytest
import torch

from benchmarks import cpu_scale_rows
from benchmarks.shapes import SHAPES, model_config


def _spec(tmp_path, engine: str, mode: str = "lora", steps: int = 2) -> dict:
    return {"shape": "tiny", "mode": mode, "engine": engine, "steps": steps,
            "prompt_ids": cpu_scale_rows.example_prompt_ids(8, "random"), "work": str(tmp_path)}


@pytest.mark.parametrize("engine", cpu_scale_rows.ENGINES)
def test_a_worker_times_its_engines_steps_and_reads_its_peak_memory(tmp_path, engine):
    result = cpu_scale_rows.worker(_spec(tmp_path, engine))
    assert len(result["steps"]) == 2 and result["step_s"] > 0
    assert 0.8 * 64 * 16 <= result["tokens"] <= 64 * 16  # counted from the mask (a tiny vocabulary ends a few rows)
    assert result["process_peak_rss_gb"] > 0.1 and result["our_estimate_gb"] > 0


def test_a_row_past_the_memory_limit_is_ended_and_says_so(tmp_path):
    result = cpu_scale_rows.run_child(_spec(tmp_path, "ours"), limit_gb=0.05, poll_s=0.05)
    assert "over the 0.05 GB limit" in result["error"] and result["sampled_peak_rss_gb"] >= 0.05  # rounded to 0.01 GB


def test_the_prompts_are_the_smollm2_examples_through_its_tokenizer():
    ids = cpu_scale_rows.example_prompt_ids(8, "smollm2")
    assert len(ids) == 8 and all(40 <= len(i) <= 60 for i in ids)
    assert max(max(i) for i in ids) < SHAPES["smollm2-135m"]["vocab_size"]


def test_growth_is_the_larger_shapes_cost_over_the_smallers():
    rows = [{"shape": s, "mode": "full", "engine": "ours", "step_s": t, "process_peak_rss_gb": m, "parameters": 1,
             "tokens": 1024, "sampled_peak_rss_gb": m, "our_estimate_gb": m}
            for s, t, m in (("smollm2-135m", 4.0, 4.0), ("qwen2.5-0.5b", 14.0, 10.0))]
    rows.append({"shape": "qwen2.5-0.5b", "mode": "full", "engine": "trl", "error": "ended at 20.1 GB",
                 "sampled_peak_rss_gb": 20.1, "parameters": 1})
    growth = cpu_scale_rows.growth(rows)
    assert growth == [{"from": "smollm2-135m", "to": "qwen2.5-0.5b", "mode": "full", "engine": "ours",
                       "parameters": 3.67, "step_time": 3.5, "peak_rss": 2.5}]
    report = {"command": "x", "machine": "m", "torch": "t", "trl": "1.16.0", "threads": 2, "steps": 3,
              "rows": rows, "growth": growth}
    assert "ended at 20.1 GB" in cpu_scale_rows.markdown(report)


@pytest.mark.parametrize("mode", ["full", "full-ckpt"])
def test_our_05b_full_fine_tuning_fits_the_limit_on_paper(mode):
    """Ours' own estimate of the 0.5B full row (weights, gradients, AdamW moments, the step's activations) is well
    under the 20 GB limit the run enforces."""
    from transformers import Qwen2ForCausalLM

    from components.engine.grpo.memory_estimate import ModelShape, estimate_step_memory

    with torch.device("meta"):
        model = Qwen2ForCausalLM(model_config("qwen2.5-0.5b"))
    cfg = cpu_scale_rows.row_config(mode)
    estimate = estimate_step_memory(ModelShape.of(model), cfg.grpo, 47, False)
    assert estimate.peak < 14 * 2**30, estimate
