"""The GRPO stage learns (measured), resumes exactly after SIGKILL, and writes its outputs."""

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest
from safetensors.torch import load_file

from components.stages.grpo import train_grpo
from components.tracking.step_log import window_mean

from conftest import LEARN, committed_params, kill_new_stages, server_processes, setup_stage_inputs


def test_a_metrics_point_is_the_mean_of_its_window():
    rows = [{"reward_mean": 0.25, "kl": 0.5}, {"reward_mean": 0.75}, {"reward_mean": 0.5, "kl": 0.25}]
    assert window_mean(rows) == {"reward_mean": 0.5, "kl": 0.375}  # kl: only the steps that logged it


def test_grpo_raises_a_learnable_reward(tmp_path, mlflow_store):
    # A random tiny model starts near 1/16 on "completion starts with 1"; GRPO must lift it clearly.
    cfg, paths = setup_stage_inputs(tmp_path, LEARN + ["grpo.steps=30"])
    summary = train_grpo(cfg, paths)
    history = (paths.plots / "grpo_steps.csv").read_text().splitlines()
    assert len(history) == 31  # header + one row per step
    assert summary["reward_mean_first10pct"] < 0.3
    assert summary["reward_mean_last10pct"] > summary["reward_mean_first10pct"] + 0.4
    assert (paths.grpo_model / "model.safetensors").exists()
    assert json.loads((paths.metrics / "grpo.json").read_text())["steps"] == 30
    assert paths.grpo_checkpoints.is_dir()  # a DVC output even with checkpointing off (checkpoint_every=0)


def test_a_stop_just_after_a_checkpoint_is_written_reports_that_checkpoint(tmp_path, mlflow_store, monkeypatch):
    """The report's "last checkpoint" is the one a rerun resumes from, also for a stop that lands between writing it
    and the next step (here: in the note written right after it)."""
    import components.stages.grpo as grpo_stage
    from components.interruptions import StageInterrupted, progress, set_progress

    class StopAfterTheCheckpoint(grpo_stage.RunMarker):
        def write(self, **fields):
            super().write(**fields)
            if fields.get("last_checkpoint") == 2:
                raise StageInterrupted(signal.SIGTERM)

    monkeypatch.setattr(grpo_stage, "RunMarker", StopAfterTheCheckpoint)
    cfg, paths = setup_stage_inputs(tmp_path, LEARN + ["grpo.steps=4", "grpo.checkpoint_every=2"])
    try:
        with pytest.raises(StageInterrupted):
            train_grpo(cfg, paths)
        assert progress() == "at step 2 of 4; the last checkpoint is step 2"
    finally:
        set_progress("")
    assert [p.name for p in paths.grpo_checkpoints.iterdir()] == ["step-0000002"]


def test_grpo_with_kl_and_mu_2_runs_and_logs_kl(tmp_path, mlflow_store):
    cfg, paths = setup_stage_inputs(tmp_path, LEARN + ["grpo.steps=4", "grpo.kl_beta=0.1",
                                                       "grpo.num_iterations=2", "grpo.reference.mode=ema"])
    train_grpo(cfg, paths)
    import csv
    rows = list(csv.DictReader((paths.plots / "grpo_steps.csv").open()))
    kl = [float(r["kl"]) for r in rows]
    # Step 1's first pass is at the reference (KL 0), its second after one update; the policy then
    # moves away from its slow EMA reference: positive at every step, and never the same twice. A
    # reference computed with the policy itself, or a KL left out, would log zeros.
    assert all(k > 0 for k in kl) and len(set(kl)) == len(kl), kl
    # With mu=2 the second pass sees ratios != 1 after a large step: some tokens are clipped.
    assert any(float(r["clip_low_frac"]) + float(r["clip_high_frac"]) > 0 for r in rows)
    # 4 steps, grpo.metrics_every 10: one MLflow point, the mean of the partial window, at the last step.
    from mlflow.tracking import MlflowClient

    client = MlflowClient(mlflow_store)
    run = client.search_runs([client.get_experiment_by_name(cfg.tracking.experiment).experiment_id],
                             "tags.`grpo.stage` = 'grpo'")[0]
    points = client.get_metric_history(run.info.run_id, "learning/kl")
    assert [p.step for p in points] == [4]
    assert points[0].value == pytest.approx(sum(float(r["kl"]) for r in rows) / 4, abs=1e-5)


def _grpo_cmd(extra):
    """The grpo stage's command; with SERVER_ENV in its environment, forked by that warm stage server."""
    sets = [x for o in LEARN + extra for x in ("--set", o)]
    return [sys.executable, "-m", "components.runtime.launch", "grpo", *sets]


@pytest.mark.slow
def test_sigkill_then_resume_gives_identical_weights(tmp_path, mlflow_store, stage_server):
    from components.runtime.stage_server import SERVER_ENV

    steps = ["grpo.steps=24", "grpo.checkpoint_every=4", "grpo.kl_beta=0.05", "grpo.reference.mode=ema"]
    env = {**os.environ, SERVER_ENV: stage_server[1]}  # the stage forked by a warm server, as a pipeline run has it
    dirs = {}
    for name in ("straight", "killed"):
        root = tmp_path / name
        root.mkdir()
        (root / "params.yaml").write_text((committed_params()).read_text())
        setup_stage_inputs(root, LEARN + steps)
        dirs[name] = root
    subprocess.run(_grpo_cmd(steps), cwd=dirs["straight"], env=env, check=True, capture_output=True)

    ckpts = dirs["killed"] / "checkpoints" / "grpo"
    already = server_processes(stage_server[0], dirs["killed"])
    proc = subprocess.Popen(_grpo_cmd(steps), cwd=dirs["killed"], env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    marker = ckpts.parent / "grpo.running.json"

    def checkpointed() -> bool:  # a checkpoint on disk, and the run's note has recorded it (written just after)
        if not (ckpts.exists() and any(p.name.startswith("step-") for p in ckpts.iterdir())):
            return False
        try:
            return bool(json.loads(marker.read_text()).get("last_checkpoint"))
        except (OSError, ValueError):
            return False

    deadline = time.time() + 120
    while time.time() < deadline and not checkpointed():
        time.sleep(0.02)
    [stage] = kill_new_stages(stage_server[0], dirs["killed"], already)  # the forked stage, then its launcher
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not (dirs["killed"] / "models" / "grpo").exists(), "the run finished before it could be killed"
    resumed = subprocess.run(_grpo_cmd(steps), cwd=dirs["killed"], env=env, check=True, capture_output=True, text=True)
    assert "resumed from" in resumed.stdout
    # SIGKILL (the out-of-memory killer's signal) leaves no word; the rerun says what happened, once
    said = [line for line in resumed.stdout.splitlines() if "ended without a word" in line]
    assert len(said) == 1 and said[0].startswith(f"grpo: the previous run of this stage (pid {stage}, started ")
    # a step of this tiny model takes a sliver of the free memory: not put down to the out-of-memory killer
    assert re.search(r"at step \d+ of 24: it was killed \(SIGKILL\), by another process or the machine", said[0])
    assert "its step was estimated at " in said[0] and "out-of-memory" not in said[0]
    assert not (dirs["killed"] / "checkpoints" / "grpo.running.json").exists()  # a clean end leaves no note
    a = load_file(dirs["straight"] / "models" / "grpo" / "model.safetensors")
    b = load_file(dirs["killed"] / "models" / "grpo" / "model.safetensors")
    assert a.keys() == b.keys()
    assert all((a[k] == b[k]).all() for k in a), "resumed weights differ from the uninterrupted run"
    assert (json.loads((dirs["straight"] / "metrics" / "grpo.json").read_text())
            == json.loads((dirs["killed"] / "metrics" / "grpo.json").read_text()))


def test_dapo_dynamic_sampling_overlong_and_truncation_masking_in_training(tmp_path, mlflow_store):
    import csv

    cfg, paths = setup_stage_inputs(tmp_path, LEARN + [
        "grpo.steps=4", "grpo.dynamic_sampling.enabled=true", "grpo.dynamic_sampling.fill_batch=true",
        "grpo.dynamic_sampling.max_tries=2", "grpo.overlong.enabled=true", "grpo.overlong.buffer=2",
        "grpo.mask_truncated_completions=true", "grpo.max_completion_length=4"])
    train_grpo(cfg, paths)
    rows = list(csv.DictReader((paths.plots / "grpo_steps.csv").open()))
    for r in rows:
        kept, sampled = float(r["kept_completions"]), float(r["sampled_completions"])
        # Only informative groups are kept; filling samples extra groups when some were dropped.
        assert kept <= sampled and kept % 8 == 0
        assert float(r["zero_std_group_frac"]) == 0 or sampled > 64 or kept < 64
        # A random model rarely emits EOS within 4 tokens: the overlong penalty is active.
        assert float(r["reward/overlong_penalty/mean"]) < 0
    assert any(float(r["sampled_completions"]) > 64 for r in rows), "batch filling never sampled extra prompts"



def test_dynamic_sampling_that_keeps_no_group_trains_nothing_and_goes_on(tmp_path, mlflow_store):
    """Every group's rewards equal (a constant reward): dynamic sampling drops them all, each step updates nothing
    and says so in its row, and the run ends with its starting weights."""
    import csv

    cfg, paths = setup_stage_inputs(tmp_path, LEARN + [
        "grpo.steps=2", "grpo.dynamic_sampling.enabled=true", "grpo.dynamic_sampling.fill_batch=false",
        "grpo.rewards=[{name: 'reward_fixtures:always_one', weight: 1.0}]"])
    train_grpo(cfg, paths)
    rows = list(csv.DictReader((paths.plots / "grpo_steps.csv").open()))
    assert [float(r["kept_completions"]) for r in rows] == [0.0, 0.0]
    assert all(float(r["sampled_completions"]) > 0 for r in rows)
    start, end = (load_file(p / "model.safetensors") for p in (paths.base_model, paths.grpo_model))
    assert start.keys() == end.keys() and all((start[k] == end[k]).all() for k in start)

def test_a_fast_path_that_cannot_be_built_leaves_training_on_the_plain_forward(tmp_path, mlflow_store, monkeypatch,
                                                                               capsys):
    """A transformers release that renames an attribute the fast path reads (here the decoder, `model` ->
    `transformer`) must not take training down: one warning naming the reason, the run completes on the plain
    Hugging Face forward."""
    import torch
    from transformers import LlamaForCausalLM
    from transformers.modeling_outputs import CausalLMOutputWithPast

    import components.engine.grpo.policy as policy_module

    class RenamedDecoderLlama(LlamaForCausalLM):
        def get_decoder(self):
            return self.transformer

        def forward(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None,
                    use_cache=None, **kwargs):
            out = self.transformer(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                                   past_key_values=past_key_values, use_cache=use_cache)
            return CausalLMOutputWithPast(logits=self.lm_head(out.last_hidden_state),
                                          past_key_values=out.past_key_values)

    load, built = policy_module.load_policy_model, []

    def load_renamed(*args, **kwargs):
        model = load(*args, **kwargs)
        model.__class__ = RenamedDecoderLlama
        model.transformer = model.model
        del model.model
        return model

    from components.engine.generation.engines import prefix_shared

    build = prefix_shared.build
    monkeypatch.setattr(policy_module, "load_policy_model", load_renamed)
    monkeypatch.setattr(prefix_shared, "build", lambda *a, **k: built.append(build(*a, **k)) or built[-1])
    cfg, paths = setup_stage_inputs(tmp_path, LEARN + ["grpo.steps=3", "grpo.prefix_sharing=true"])
    summary = train_grpo(cfg, paths)
    out = capsys.readouterr().out
    assert built and all(engine is None for engine in built)  # training's engine and the held-out probe's
    warning = [line for line in out.splitlines() if "prefix sharing off" in line]
    assert len(warning) == 1, out
    assert warning[0].startswith("grpo: prefix sharing off: building or checking the prompt-once forward failed "
                                 "(AttributeError: ") and "has no attribute 'model'" in warning[0], warning
    assert summary["steps"] == 3 and torch.isfinite(torch.tensor(summary["reward_mean_last10pct"]))
