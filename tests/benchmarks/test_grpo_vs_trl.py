"""The benchmark's rule for reporting "time to reach TRL's final held-out reward" (benchmarks/grpo_vs_trl.py),
on curves worked out by hand, and the TRL settings it derives from the pipeline's config."""

import math

import pytest

from benchmarks.grpo_vs_trl import ROWS, noise_band, row_config, steady_rise, time_to_trl_reward, trl_settings
from benchmarks.machine_ceiling import phase_utilisation


def curve(values: list[float], seconds: float = 10.0) -> list[dict[str, float]]:
    return [{"completions": 100 * (i + 1), "train_seconds": seconds * (i + 1), "heldout": v}
            for i, v in enumerate(values)]


def test_noise_band_is_the_binomial_half_width():
    assert noise_band(0.5, 1000) == pytest.approx(1.96 * math.sqrt(0.25 / 1000))  # 0.031
    assert noise_band(0.0, 100) == pytest.approx(1.96 * math.sqrt(1 / 100 / 100))  # floored at 1/n


def test_a_steady_rise_passes_and_dips_within_the_band_are_allowed():
    # n = 300: band at 0.5 is 0.0566; 0.62 -> 0.60 is a dip of 0.02, inside it
    assert steady_rise(0.3, curve([0.45, 0.62, 0.60, 0.71]), 300) is None


def test_a_fall_beyond_the_band_or_a_rise_within_noise_is_refused():
    fell = steady_rise(0.55, curve([0.07, 0.3, 0.7]), 1000)  # the tiny default's first-round dip
    assert fell is not None and "fell 0.480" in fell
    flat = steady_rise(0.34, curve([0.36, 0.42]), 50)  # +0.08 against twice the band at 0.34, n=50 (0.263)
    assert flat is not None and "within twice the noise band" in flat


def test_time_to_reward_is_reported_only_when_both_curves_rise_and_ours_crosses_later():
    ours, trl = curve([0.45, 0.65, 0.72, 0.75], 20.0), curve([0.37, 0.52, 0.70, 0.75], 100.0)
    reported = time_to_trl_reward(0.317, {"ours": ours, "trl": trl}, 300, trl_seconds=400.0)
    assert reported == {"reported": True, "ours_train_seconds": 80.0, "trl_train_seconds": 400.0, "fraction": 0.2}
    early = time_to_trl_reward(0.317, {"ours": curve([0.80, 0.82, 0.85, 0.86]), "trl": trl}, 300, 400.0)
    assert not early["reported"] and "at its first evaluation" in early["why_not"]
    never = time_to_trl_reward(0.317, {"ours": curve([0.45, 0.6, 0.65, 0.7]), "trl": trl}, 300, 400.0)
    assert not never["reported"] and "never reached" in never["why_not"]


@pytest.mark.parametrize("row", ["smollm2-lora", "smollm2-full", "tiny", "smollm2-long", "calculator"])
def test_trl_is_configured_from_the_same_config(tmp_path, row):
    cfg = row_config(ROWS[row], ["grpo.steps=40"])
    args = trl_settings(cfg, 40, tmp_path, ROWS[row].trl_memory)
    g = cfg.grpo
    assert args["per_device_train_batch_size"] == g.prompts_per_step * g.group_size
    assert (args["num_generations"], args["max_completion_length"], args["temperature"], args["learning_rate"],
            args["beta"], args["loss_type"], args["warmup_steps"]) == \
        (g.group_size, g.max_completion_length, g.temperature, g.learning_rate, g.kl_beta, g.loss_type, g.warmup_steps)
    assert args["lr_scheduler_kwargs"] == {"min_lr_rate": g.min_lr_ratio} and args["use_cpu"] and not args["bf16"]
    assert cfg.grpo.lora.enabled == (row in ("smollm2-lora", "smollm2-long", "calculator"))
    # the long rows: both engines recomputing layers so that both stay resident
    long = row in ("smollm2-long", "calculator")
    assert args["gradient_checkpointing"] == long == (cfg.grpo.gradient_checkpointing == "always")
    if row == "smollm2-long":
        assert (args["max_completion_length"], args["temperature"], args["top_k"]) == (128, 1.0, 0)
    # tool episodes: TRL's tool-calling iterations are the model turns after the first, its budget the whole episode
    assert args.get("max_tool_calling_iterations") == (2 if row == "calculator" else None)
    if row == "calculator":
        assert (cfg.grpo.tools, cfg.grpo.episode.max_turns, args["max_completion_length"], args["temperature"],
                cfg.grpo.prompts_per_step, g.lora.rank, cfg.task.n_heldout) == (["calculator"], 3, 96, 0.8, 4, 16, 500)


def test_a_user_environment_is_refused_on_the_trl_side(tmp_path):
    user = "grpo.environment=tests.environment_fixtures:game_server_down"
    cfg = row_config(ROWS["calculator"], ["grpo.tools=[]", user])
    with pytest.raises(SystemExit, match="grpo.environment"):
        trl_settings(cfg, 10, tmp_path)


def test_settings_trl_would_compute_differently_are_refused(tmp_path):
    cfg = row_config(ROWS["tiny"], ["grpo.reference.mode=ema"])
    with pytest.raises(SystemExit, match="reference.mode"):
        trl_settings(cfg, 10, tmp_path)


def test_update_replaces_measured_rows_and_keeps_the_others_with_their_commit():
    from benchmarks.grpo_vs_trl import merged_rows

    previous = {"commit": "old", "machine": "m1", "rows": [{"row": "smollm2-full", "x": 1}, {"row": "tiny", "x": 2},
                                                            {"row": "smollm2-lora", "x": 3, "commit": "older"}]}
    fresh = [{"row": "tiny", "x": 9, "commit": "new", "machine": "m2"}]
    rows = merged_rows(previous, fresh)
    assert [r["row"] for r in rows] == ["tiny", "smollm2-lora", "smollm2-full"]
    assert rows[0] == fresh[0]
    assert (rows[1]["x"], rows[1]["commit"], rows[1]["machine"]) == (3, "older", "m1")
    assert (rows[2]["x"], rows[2]["commit"]) == (1, "old")


def test_phase_shares_of_the_ceiling_are_worked_out_from_the_parameter_count():
    machine = {"matmul_gflops": 100.0, "bandwidth_gbs": 10.0}
    # 2 steps of 10 completions, 50 completion tokens each step in all, 20-token prompts, 8 decode steps each
    steps = [{"completions": 10, "tokens": 50.0, "decode_steps": 8.0, "generation": 2.0, "policy": 4.0,
              "reference": 1.0} for _ in range(2)]
    lora = phase_utilisation(1_000_000_000, 0, 4_000_000_000, [{**s, "prompt_tokens": 20.0} for s in steps], machine)
    # generation: 2N x 100 tokens / 4 s = 50 GFLOP/s of 100; 16 decode steps x 4 GB / 4 s = 16 GB/s of 10
    assert lora["generation_flops_frac"] == 0.5 and lora["generation_bandwidth_frac"] == 1.6
    # rows' tokens: 100 completion + 2 x 10 x 20 prompt = 500; LoRA update 4N x 500 / 8 s = 250 GFLOP/s
    assert lora["policy_flops_frac"] == 2.5 and lora["reference_flops_frac"] == 5.0  # 2N x 500 / 2 s = 500
    full = phase_utilisation(1_000_000_000, 1_000_000_000, 4_000_000_000,
                             [{**s, "prompt_tokens": 20.0} for s in steps], machine)
    assert full["policy_flops_frac"] == 3.75 and full["gflops_by_phase"]["policy"] == 375.0  # 6N


def test_a_share_of_the_ceiling_above_one_is_named_not_printed():
    from benchmarks.grpo_vs_trl import ceiling_share

    assert ceiling_share(0.456) == "46%" and ceiling_share(1.0) == "100%"
    assert ceiling_share(4.17) == "above 100%"  # less work done than counted (a group's prompt once), not 417%


def test_the_evaluation_peak_is_kept_apart_from_the_training_peak():
    """A freed 400 MB block raises the peak; after a reset the peak is back near the current resident memory.
    Run in a fresh interpreter: an earlier test in this process may have told glibc to keep freed memory."""
    import subprocess
    import sys

    import pytest

    from conftest import ROOT

    script = """
import sys
from benchmarks.grpo_vs_trl import peak_rss_mb, reset_peak_rss
if not reset_peak_rss():
    sys.exit(3)
base = peak_rss_mb()
block = bytearray(400 * 2**20)
block[:: 4096] = b"x" * len(block[:: 4096])  # touch every page
del block
raised = peak_rss_mb()
reset_peak_rss()
print(base, raised, peak_rss_mb())
"""
    if not sys.platform.startswith("linux"):
        pytest.skip("resetting the peak needs Linux's /proc/self/clear_refs")
    proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True)
    if proc.returncode == 3:
        pytest.skip("/proc/self/clear_refs is not writable here")
    base, raised, after = map(float, proc.stdout.split())
    assert raised > base + 350
    assert after < base + 100
