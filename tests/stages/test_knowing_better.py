"""Knowing when a model is better: held-out evaluation during GRPO (curves, LoggedModels, keep best),
reward-hacking monitors that block promotion, and the not-learning warning, on real runs."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from components.stages.grpo import train_grpo

from conftest import LEARN, setup_stage_inputs

pytestmark = pytest.mark.integration


def _grpo_run(client, experiment: str):
    exp = client.get_experiment_by_name(experiment)
    return client.search_runs([exp.experiment_id], "tags.`grpo.stage` = 'grpo'",
                              order_by=["attributes.start_time DESC"])[0]


def test_heldout_curves_logged_models_and_keep_best(tmp_path, mlflow_store, capsys):
    import mlflow
    from mlflow.tracking import MlflowClient

    cfg, paths = setup_stage_inputs(tmp_path, LEARN + [
        "grpo.steps=30", "evaluate.every=10", "evaluate.during_training_n=20", "grpo.keep=best",
        "grpo.log_every=10", "evaluate.metrics=[reward, completion_length, eos_rate]"])
    summary = train_grpo(cfg, paths)
    out = capsys.readouterr().out
    evals = summary["heldout_evaluations"]
    assert [e["step"] for e in evals] == [0, 10, 20, 30]  # step 0: the model GRPO started from
    assert set(evals[0]) == {"step", "reward", "completion_length", "eos_rate"}
    assert set(evals[1]) == {*evals[0], "reward_vs_start", "reward_vs_start_se"}
    assert all(e["reward_vs_start"] == pytest.approx(e["reward"] - evals[0]["reward"], abs=1e-5) for e in evals[1:])
    assert "| held-out reward" in out and " vs start)" in out  # the progress line carries the evaluation
    # It learned, and the held-out curve rose with the training reward: no flat-curve warning.
    assert summary["generalisation"]["heldout_rose"] and "over the run: training reward +" in out
    assert not next(m for m in summary["monitors"] if m["signal"] == "heldout_flat")["breached"]
    # keep: best -> the first evaluation with the highest held-out reward; its weights became models/grpo.
    evals = evals[1:]  # the start is not a candidate for `best`
    best = max(evals, key=lambda e: (e["reward"], -e["step"]))
    assert summary["kept"] == {"mode": "best", "step": best["step"], "metric": "reward", "value": best["reward"]}
    saved = load_file(str(paths.grpo_checkpoints / "best" / "model.safetensors"))
    final = load_file(str(paths.grpo_model / "model.safetensors"))
    tied = {"model.embed_tokens.weight": "lm_head.weight"}  # each file keeps one name of the tied pair
    assert len(final) == len(saved)
    assert all(torch.equal(saved[k if k in saved else tied[k]], v) for k, v in final.items())
    assert json.loads((paths.grpo_checkpoints / "best" / "meta.json").read_text())["step"] == best["step"]
    # One CSV row per step; the held-out columns filled on the evaluated steps only.
    rows = list(csv.DictReader((paths.plots / "grpo_steps.csv").open()))
    assert [int(r["step"]) for r in rows if r["heldout/reward"]] == [10, 20, 30]
    assert (paths.plots / "grpo_heldout.png").read_bytes()[:4] == b"\x89PNG"
    # MLflow: a curve against the step, and one LoggedModel per evaluated checkpoint with its metrics.
    client = MlflowClient(mlflow_store)
    run = _grpo_run(client, cfg.tracking.experiment)
    curve = client.get_metric_history(run.info.run_id, "heldout/reward")
    assert [(p.step, p.value) for p in curve] == [(e["step"], pytest.approx(e["reward"], abs=1e-6))
                                                  for e in summary["heldout_evaluations"]]
    assert run.data.tags["grpo.kept_step"] == str(best["step"])
    mlflow.set_tracking_uri(mlflow_store)
    models = mlflow.search_logged_models(experiment_ids=[run.info.experiment_id], output_format="list")
    by_step = {int(m.tags["grpo.step"]): m for m in models}
    assert sorted(by_step) == [10, 20, 30] and all(m.source_run_id == run.info.run_id for m in models)
    for e in evals:
        metrics = {m.key: m.value for m in by_step[e["step"]].metrics}
        assert metrics["heldout/reward"] == pytest.approx(e["reward"], abs=1e-6)
    assert [s for s, m in by_step.items() if "grpo.kept" in m.tags] == [best["step"]]


def test_evaluating_during_training_leaves_training_unchanged(tmp_path, mlflow_store):
    weights = []
    for every in (0, 3):
        cfg, paths = setup_stage_inputs(tmp_path / str(every), LEARN + ["grpo.steps=8", f"evaluate.every={every}",
                                                                          "evaluate.during_training_n=10"])
        train_grpo(cfg, paths)
        weights.append(load_file(str(paths.grpo_model / "model.safetensors")))
    assert all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])


def test_not_learning_is_said_while_it_runs_and_not_when_learning(tmp_path, mlflow_store, capsys):
    from mlflow.tracking import MlflowClient

    watch = ["monitors.not_learning.window=10", "grpo.log_every=10", "evaluate.every=0"]
    cfg, paths = setup_stage_inputs(tmp_path / "stuck", LEARN + watch + ["grpo.steps=20", "grpo.learning_rate=1e-9",
                                                                   "monitors.not_learning.zero_variance_above=0.2"])
    summary = train_grpo(cfg, paths)
    out = capsys.readouterr().out
    assert "grpo: WARNING at step 20: not learning: training reward" in out
    assert "of groups score zero on every completion" in out and "dynamic_sampling" in out
    assert summary["not_learning"].startswith("not learning")
    run = _grpo_run(MlflowClient(mlflow_store), cfg.tracking.experiment)
    assert run.data.tags["warning.not_learning"].startswith("step 20: not learning")

    cfg, paths = setup_stage_inputs(tmp_path / "learning", LEARN + watch + ["grpo.steps=30"])
    summary = train_grpo(cfg, paths)
    assert "not learning" not in capsys.readouterr().out and summary["not_learning"] is None
    assert summary["reward_mean_last10pct"] > summary["reward_mean_first10pct"] + 0.3  # it did learn


def test_a_flat_heldout_curve_is_named_in_the_progress_and_the_model_card(tmp_path, mlflow_store, capsys):
    """Training learns to start with 1 while the held-out split asks for 7: the training reward rises, the
    held-out one cannot. The last progress line, the monitor and the model card name it."""
    import shutil

    from mlflow.tracking import MlflowClient

    from components.data.records import read_jsonl, split_path
    from components.stages.evaluate import evaluate
    from components.stages.register import register

    from conftest import committed_params

    cfg, paths = setup_stage_inputs(tmp_path, LEARN + [
        "grpo.steps=30", "evaluate.every=10", "evaluate.during_training_n=20", "evaluate.metrics=[reward]",
        "evaluate.bootstrap_samples=500", "reports.samples_every=0",
        "grpo.rewards=[{name: 'reward_fixtures:starts_with_digit', weight: 1.0}]"])
    heldout = split_path(paths.data, "heldout")
    heldout.write_text("".join(json.dumps({**r, "digit": "7"}) + "\n" for r in read_jsonl(heldout)))
    shutil.copy(committed_params(), tmp_path / "params.yaml")
    summary = train_grpo(cfg, paths)
    out = capsys.readouterr().out
    run = summary["generalisation"]
    assert run["train_gain"] > 0.3 and not run["heldout_rose"]
    assert run["text"].endswith(": learning that does not generalise")
    assert f"grpo: over the run: {run['text']}" in out
    flat = next(m for m in summary["monitors"] if m["signal"] == "heldout_flat")
    assert flat["breached"] and flat["action"] == "warn" and flat["breach"]["step"] == 30
    assert "grpo: monitor breached: heldout_flat = " in out
    evaluate(cfg, paths)
    decision = register(cfg, paths)
    assert not decision["promoted"]  # no better than its start on held-out: the first-champion rule
    card = MlflowClient(mlflow_store).get_model_version(cfg.register.model_name, "1").description
    assert "learning that does not generalise" in card
    assert "| heldout_flat | > 0.1 | warn | **breached** at step 30" in card


def test_no_signal_is_said_within_ten_steps_with_two_samples(tmp_path, mlflow_store, capsys):
    """A reward that scores nothing (as an extraction that never finds the answer): by step 10 of a 40-step run the
    progress says so once, with two sampled completions and the likely causes; a run that learns hears nothing."""
    from mlflow.tracking import MlflowClient

    quiet = ["evaluate.every=0", "grpo.log_every=10"]
    cfg, paths = setup_stage_inputs(tmp_path / "zero", LEARN + quiet + [
        "grpo.steps=40", "grpo.rewards=[{name: 'reward_fixtures:always_zero', weight: 1.0}]"])
    train_grpo(cfg, paths)
    out = capsys.readouterr().out
    assert out.count("grpo: WARNING at step 10: no signal: 100% of groups in the first 10 steps scored every "
                     "completion alike (100% all zero") == 1
    samples = [line for line in out.splitlines() if line.startswith("  sample: ")]
    assert len(samples) == 2 and all(line.endswith("(reward 0.0)") for line in samples)
    assert "Likely causes: the reward's answer extraction" in out and "prompt.template" in out
    run = _grpo_run(MlflowClient(mlflow_store), cfg.tracking.experiment)
    assert run.data.tags["warning.no_signal"].startswith("step 10: no signal: 100%")

    cfg, paths = setup_stage_inputs(tmp_path / "learning", LEARN + quiet + ["grpo.steps=12"])
    train_grpo(cfg, paths)
    assert "no signal" not in capsys.readouterr().out


def test_merge_lora_registers_one_full_model_that_answers_as_the_adapter_did(tmp_path, mlflow_store):
    """`register.merge_lora: true`: the version holds the adapter merged into its base (full weights, no adapter
    files, no base to fetch), and loaded through MLflow it writes the completions the evaluate stage scored."""
    import shutil

    import mlflow
    import pandas as pd
    from mlflow.tracking import MlflowClient

    from components.data.records import read_jsonl
    from components.stages.evaluate import evaluate
    from components.stages.register import register

    from conftest import committed_params

    cfg, paths = setup_stage_inputs(tmp_path, LEARN + [
        "grpo.steps=12", "grpo.lora.enabled=true", "grpo.learning_rate=0.01", "register.merge_lora=true",
        "register.model_name=tiny-merged", "evaluate.every=0", "evaluate.metrics=[reward]",
        "evaluate.bootstrap_samples=500", "reports.samples_every=0"])
    shutil.copy(committed_params(), tmp_path / "params.yaml")
    train_grpo(cfg, paths)
    assert (paths.grpo_model / "adapter_config.json").exists()  # training left an adapter
    evaluate(cfg, paths)
    register(cfg, paths)
    client = MlflowClient(mlflow_store)
    version = client.get_model_version("tiny-merged", "1")
    assert version.tags["model.kind"] == "lora-merged"
    mlflow.set_tracking_uri(mlflow_store)
    local = Path(mlflow.artifacts.download_artifacts("models:/tiny-merged/1", dst_path=str(tmp_path / "dl")))
    files = {f.name for f in local.rglob("*") if f.is_file()}
    assert "model.safetensors" in files and "adapter_config.json" not in files
    assert "base_model_uri" not in (local / "MLmodel").read_text()
    rows = read_jsonl(paths.eval_dir / "predictions.jsonl")[:20]
    model = mlflow.pyfunc.load_model("models:/tiny-merged/1")
    served = model.predict(pd.DataFrame({"prompt": [r["prompt"] for r in rows]}))
    assert list(served) == [r["candidate_completion"] for r in rows]
    assert any(r["candidate_completion"] != r["baseline_completion"] for r in rows)  # the adapter changed answers


HACK = ["task.n_sft=300", "task.n_train=200", "task.n_heldout=40", "sft.epochs=3", "sft.stop_at_reward=null",
        "threads=1", "grpo.rewards=[{name: 'reward_fixtures:pays_for_length', weight: 1.0}]",
        "grpo.learning_rate=0.003", "grpo.warmup_steps=0", "grpo.kl_beta=0.0", "grpo.checkpoint_every=0",
        "grpo.log_every=20", "evaluate.every=0", "evaluate.metrics=[reward, exact_match, completion_length]",
        "evaluate.bootstrap_samples=500", "monitors.window=10", "reports.samples_every=0"]
GATE = "monitors.checks=[{signal: completion_length_growth, above: 0.3, action: block}]"


def test_a_hacked_reward_is_blocked_from_champion(tmp_path, mlflow_store, capsys):
    """A reward that pays for length: the longer completions 'beat' the champion on that reward, but the
    length monitor blocks the promotion and the champion stays."""
    import shutil

    from mlflow.tracking import MlflowClient

    from components.config import load_config
    from components.stages.evaluate import evaluate
    from components.stages.register import register

    from conftest import committed_params

    # The champion: the warm start barely moved (one step at a tiny learning rate), no monitors; no better than its
    # start, so it is champion only because this registry opts out of the first-champion rule.
    cfg, paths = setup_stage_inputs(tmp_path, HACK + ["grpo.steps=1", "grpo.learning_rate=1e-9", "monitors.checks=[]",
                                                      "register.require_improvement=false"])
    shutil.copy(committed_params(), tmp_path / "params.yaml")
    train_grpo(cfg, paths)
    evaluate(cfg, paths)
    first = register(cfg, paths)
    assert first["promoted"] and first["version"] == "1" and "register.require_improvement: false" in first["reason"]

    hacked = load_config(committed_params(), HACK + ["grpo.steps=60", GATE])
    summary = train_grpo(hacked, paths)
    monitor = summary["monitors"][0]
    assert monitor["breached"] and monitor["breach"]["value"] > 0.3, summary["monitors"]
    report = evaluate(hacked, paths)
    assert report["metrics"]["completion_length"]["improvement"]["mean"] > 0  # it learned to write more
    capsys.readouterr()
    second = register(hacked, paths)
    out = capsys.readouterr().out
    assert second["version"] == "2" and not second["promoted"] and second["blocked_by"] == ["completion_length_growth"]
    assert "monitor breached: completion_length_growth" in second["reason"]
    assert "beats champion v1 on held-out reward" in second["reason"]  # the gate metric alone would promote it
    assert "register: monitor completion_length_growth > 0.3 breached at step" in out
    client = MlflowClient(mlflow_store)
    assert str(client.get_model_version_by_alias(cfg.register.model_name, "champion").version) == "1"
    tags = client.get_model_version(cfg.register.model_name, "2").tags
    assert tags["monitor.completion_length_growth"].startswith("breached:")
    assert tags["promotion.decision"] == "challenger"
    grpo_run = _grpo_run(client, cfg.tracking.experiment)
    assert "completion_length_growth" in grpo_run.data.tags["monitor.completion_length_growth"]
    card = client.get_model_version(cfg.register.model_name, "2").description
    assert "**breached** at step" in card and "Decision: challenger" in card


def test_the_first_champion_must_beat_the_model_it_started_from(tmp_path, mlflow_store, capsys):
    """A first version that did not improve on its start stays challenger and leaves no champion; one that did is
    champion; the card and the summary line say which rule decided and show both comparisons."""
    import shutil

    from mlflow.exceptions import MlflowException
    from mlflow.tracking import MlflowClient

    from components.config import load_config
    from components.stages.evaluate import evaluate
    from components.stages.register import register

    from conftest import committed_params

    quiet = ["evaluate.every=0", "evaluate.metrics=[reward]", "evaluate.bootstrap_samples=500",
             "reports.samples_every=0"]
    cfg, paths = setup_stage_inputs(tmp_path, LEARN + quiet + ["grpo.steps=2", "grpo.learning_rate=1e-9"])
    shutil.copy(committed_params(), tmp_path / "params.yaml")
    train_grpo(cfg, paths)
    evaluate(cfg, paths)
    capsys.readouterr()
    flat = register(cfg, paths)
    out = capsys.readouterr().out
    client = MlflowClient(mlflow_store)
    name = cfg.register.model_name
    assert not flat["promoted"] and flat["champion_version"] is None and flat["vs_baseline"]["ci95_low"] <= 0
    assert flat["reason"].startswith("no better than its starting point (the base model) on held-out reward: ")
    assert "register.require_improvement: false promotes it anyway" in flat["reason"]
    with pytest.raises(MlflowException):
        client.get_model_version_by_alias(name, "champion")
    assert client.get_model_version(name, "1").tags["promotion.decision"] == "challenger"
    card = client.get_model_version(name, "1").description
    assert "Decision: challenger.** no better than its starting point" in card
    assert "Rule: first version: must beat its starting point." in card
    assert "register: held-out reward: vs its starting point +0.0000 (95% CI" in out
    assert "vs the champion none yet" in out

    learned = load_config(committed_params(), LEARN + quiet + ["grpo.steps=30"])
    train_grpo(learned, paths)
    report = evaluate(learned, paths)
    assert report["improvement"]["ci95_low"] > 0
    second = register(learned, paths)
    out = capsys.readouterr().out
    assert second["promoted"] and second["version"] == "2" and second["vs_baseline"] == report["improvement"]
    assert second["reason"].startswith("no champion yet; beats its starting point (the base model) on held-out "
                                       "reward: +")
    assert str(client.get_model_version_by_alias(name, "champion").version) == "2"
    assert "Rule: first version: must beat its starting point." in client.get_model_version(name, "2").description
    imp = report["improvement"]
    assert (f"vs its starting point {imp['mean']:+.4f} (95% CI {imp['ci95_low']:+.4f} .. {imp['ci95_high']:+.4f}); "
            "vs the champion none yet") in out
