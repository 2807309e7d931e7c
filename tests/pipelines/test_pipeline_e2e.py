"""The whole pipeline on real components: a Prefect flow run, a git+DVC repo, an MLflow SQLite store.

One completed run (module fixture) is then checked from every side: outputs, MLflow runs, the
registry and its lineage tags, a fresh-process pyfunc load, the Prefect markdown artifact, DVC's
up-to-date and selective re-run behaviour, and a bad dataset stopped at validate.
"""

from __future__ import annotations

import contextlib
import csv
import json
import os
import re
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import BIN, FAST_PARAMS, ROOT, copy_committed_project, dvc_repro_warm, run

pytestmark = pytest.mark.slow

STAGES = {"prepare", "model", "validate", "sft", "grpo", "evaluate", "register"}


@pytest.fixture(scope="module")
def completed(tmp_path_factory, prefect_home, _one_stage_server_per_worker):
    """A fast run of the CLI, and the folders of the stages that the worker's shared stage server (named in the
    environment the CLI inherits) forked while it ran."""
    import psutil

    repo = copy_committed_project(tmp_path_factory.mktemp("e2e") / "repo")
    env = {"MLFLOW_TRACKING_URI": f"sqlite:///{repo / 'mlflow.db'}",
           "PREFECT_HOME": prefect_home(repo.parent / "prefect-home")}
    cli = [str(BIN / "grpo-pipeline"), "run"] + [x for o in FAST_PARAMS for x in ("--set", o)]
    # The run's own temporary Prefect API (not the worker's shared one): the tests below read its database.
    inherited = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}
    proc = subprocess.Popen(cli, cwd=repo, env={**inherited, **env}, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    shared, forked_in = psutil.Process(_one_stage_server_per_worker[0].pid), set()
    while proc.poll() is None:
        for child in shared.children(recursive=True):
            with contextlib.suppress(psutil.Error):
                forked_in.add(child.cwd())
        time.sleep(0.05)
    out = proc.stdout.read()
    assert proc.returncode == 0, out[-4000:]
    return {"repo": repo, "env": env, "output": out, "shared_server_ran_in": forked_in}


def test_a_run_uses_the_stage_server_named_in_its_environment(completed):
    """`grpo-pipeline run` with GRPO_STAGE_SERVER naming a server that accepts its environment forks its stages there
    instead of starting its own (the suite's runs share one per worker: tests/conftest.py)."""
    assert str(completed["repo"]) in completed["shared_server_ran_in"], completed["shared_server_ran_in"]
    assert "stage server: not used" not in completed["output"]


USER_STATE = ("params.yaml", "dvc.lock", "data/prepared", "models", "metrics", "plots")


def tree_hashes(repo: Path, rels: tuple[str, ...]) -> dict[str, str]:
    """sha256 of every file under each path (a path that does not exist is recorded as absent)."""
    import hashlib

    hashes = {}
    for rel in rels:
        target = repo / rel
        files = [target] if target.is_file() else sorted(p for p in target.rglob("*") if p.is_file()) \
            if target.exists() else []
        hashes.update({str(f.relative_to(repo)): hashlib.sha256(f.read_bytes()).hexdigest() for f in files})
        if not target.exists():
            hashes[rel] = "absent"
    return hashes


def mlflow_client(env):
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=env["MLFLOW_TRACKING_URI"])


def ran_stages(output: str) -> set[str]:
    return set(re.findall(r"Running stage '(\w+)'", output))


def test_run_prints_before_after_and_model_uri(completed):
    out = completed["output"]
    assert re.search(r"held-out mean reward before GRPO: \d\.\d{4}", out)
    assert re.search(r"held-out mean reward after GRPO:  \d\.\d{4}", out)
    assert ("registered model: models:/grpo-addition/1 -> champion (no champion yet (register.require_improvement: "
            "false: the first version is champion whatever it measured; against its starting point (the SFT warm "
            "start): ") in out
    assert ran_stages(out) == STAGES
    # DVC's lines once each (not again through Prefect's console handler), its git hint once per run
    assert all(out.count(f"Running stage '{stage}'") == 1 for stage in STAGES), out
    assert "To track the changes with git" not in out
    assert out.count("record the run in git: git add -f dvc.lock params.yaml metrics plots/*.png") == 1


def test_run_reports_overhead_and_shuts_down_without_prefect_log_errors(completed):
    out = completed["output"]
    assert re.search(r"orchestration overhead: [\d.]+ s of [\d.]+ s wall", out)
    assert re.search(r"where: before first stage [\d.]+ s, stage warm ups [\d.]+ s, between stages [\d.]+ s, "
                     r"after last stage [\d.]+ s", out)
    # Prefect's log worker used to retry against the stopped temporary API until exit (over a minute).
    assert "Error logging to API" not in out and "All connection attempts failed" not in out


# What a run's log may hold: the pipeline's own lines, DVC's stage lines, Prefect's task states, the summary.
OWN_LINES = re.compile(
    r"^(?:(?:prepare|model|validate|sft|grpo|evaluate|register|tracking|params\.yaml)\b|  sample: "
    r"|Running stage '|> python -m components\.runtime\.launch |(?:Generating|Updating) lock file 'dvc\.lock'"
    r"|\d\d:\d\d:\d\d\.\d{3} \| INFO    \| (?:Flow run|Task run) "
    r"|={20,}$|held-out mean reward |expected band: |registered model: |load it with: |record the run in git: "
    r"|orchestration overhead: |  where: |$)")


def test_a_run_shows_the_pipelines_own_lines_only(completed):
    """No other program's progress bar or start-up chatter (transformers' weight loading and shard writing,
    MLflow's store creation): every line is the pipeline's, DVC's stage line, or Prefect's task state."""
    lines = completed["output"].splitlines()
    foreign = [line for line in lines if not OWN_LINES.match(line)]
    assert foreign == [], foreign
    assert not any(bar in completed["output"] for bar in ("it/s]", "Loading weights", "Writing model shards",
                                                           "Downloading artifacts", "de-quantizing"))
    assert len(lines) <= 80  # 75 on the fast settings: about ten per stage


def test_eval_and_register_metrics_files(completed):
    repo = completed["repo"]
    ev = json.loads((repo / "metrics" / "eval.json").read_text())
    assert ev["n"] == 120
    for key in ("mean_reward",):
        assert 0.0 <= ev["baseline"][key] <= 1.0 and 0.0 <= ev["candidate"][key] <= 1.0
    imp = ev["improvement"]
    assert imp["ci95_low"] <= imp["mean"] <= imp["ci95_high"]
    assert imp["mean"] == pytest.approx(ev["candidate"]["mean_reward"] - ev["baseline"]["mean_reward"])
    reg = json.loads((repo / "metrics" / "register.json").read_text())
    assert reg["promoted"] is True and reg["version"] == "1"


def test_mlflow_parent_run_with_one_nested_run_per_stage(completed):
    client = mlflow_client(completed["env"])
    exp = client.get_experiment_by_name("grpo-pipeline")
    runs = client.search_runs([exp.experiment_id])
    parents = [r for r in runs if r.data.tags.get("grpo.stage") == "pipeline"]
    assert len(parents) == 1 and parents[0].info.status == "FINISHED"
    parent = parents[0]
    assert parent.data.params["grpo.kl_beta"] == "0.04" and parent.data.params["grpo.steps"] == "6"
    assert parent.data.params["evaluate.max_new_tokens"] == "6"  # a token count, not a secret token
    # Named after what ran, so runs can be told apart in the run list; children by their stage.
    assert parent.info.run_name.startswith("grpo-addition · dapo β0.04 · 20"), parent.info.run_name
    children = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id]
    assert {r.data.tags["grpo.stage"] for r in children} == STAGES
    assert {r.info.run_name for r in children} == STAGES
    grpo = next(r for r in children if r.data.tags["grpo.stage"] == "grpo")
    # One MLflow point per grpo.metrics_every=2 steps, each the mean of its steps in plots/grpo_steps.csv.
    history = client.get_metric_history(grpo.info.run_id, "learning/reward_mean")
    assert [m.step for m in history] == [2, 4, 6]
    with (completed["repo"] / "plots" / "grpo_steps.csv").open() as fh:
        per_step = [float(row["reward_mean"]) for row in csv.DictReader(fh)]
    assert len(per_step) == 6
    for point in history:
        assert point.value == pytest.approx((per_step[point.step - 2] + per_step[point.step - 1]) / 2, abs=1e-5)
    # The charts that say whether training works come first (learning/), the rest grouped by prefix.
    for key in ("learning/reward_mean", "learning/reward_std", "learning/kl", "learning/entropy",
                "learning/completion_length", "optim/loss", "optim/pg_loss",
                "optim/advantage_mean", "optim/logprob_mean", "rollout/zero_std_group_frac", "optim/grad_norm",
                "optim/learning_rate", "time/step_seconds", "time/completions_per_s", "time/generation"):
        assert key in grpo.data.metrics, key
    assert all("/" in k for k in grpo.data.metrics) and not any(k.startswith("final/") for k in grpo.data.metrics)
    validate = next(r for r in children if r.data.tags["grpo.stage"] == "validate")
    assert [a.path for a in client.list_artifacts(validate.info.run_id)] == ["data_docs", "validation.json"]
    docs = {a.path for a in client.list_artifacts(validate.info.run_id, "data_docs")}
    assert {"data_docs/index.html", "data_docs/train.html", "data_docs/heldout.html"} <= docs


def test_registered_version_carries_lineage_and_champion_alias(completed):
    client = mlflow_client(completed["env"])
    version = client.get_model_version_by_alias("grpo-addition", "champion")
    assert str(version.version) == "1"
    tags = version.tags
    head = run(["git", "rev-parse", "HEAD"], completed["repo"]).stdout.strip()
    assert tags["lineage.git_commit"].startswith(head)
    lock = (completed["repo"] / "dvc.lock").read_text()
    for split in ("sft", "train", "heldout"):
        assert re.fullmatch(r"[0-9a-f]{32}", tags[f"data.{split}.md5"])
    assert tags["data.heldout.md5"] == tags["eval.heldout_md5"]
    assert re.fullmatch(r"[0-9a-f]{16}", tags["lineage.params_hash"])
    assert re.fullmatch(r"[0-9a-f]{32}", tags["lineage.lock_md5"])
    assert tags["dvc.models/grpo.md5"].endswith(".dir") and tags["dvc.data/prepared.md5"].endswith(".dir")
    assert tags["dvc.models/grpo.md5"] in lock
    assert "md5:" in lock
    assert tags["promotion.decision"] == "champion" and tags["registration"] == "complete"
    assert float(tags["eval.improvement_ci95_low"]) <= float(tags["eval.improvement"])
    # Grouped by prefix: nothing but the registration flag is left without one.
    assert {k for k in tags if "." not in k} == {"registration"}, sorted(tags)
    assert str(client.get_model_version_by_alias("grpo-addition", "challenger").version) == "1"
    # The version page leads with its model card: the decision, then the held-out metrics with CIs.
    assert version.description.startswith("## Model card: grpo-addition v1\n\n**Decision: champion.** no champion yet "
                                          "(register.require_improvement: false")
    assert "Rule: first version: no improvement required (register.require_improvement: false)." in version.description
    assert "| reward (gate) | " in version.description
    assert f" | {float(tags['eval.heldout_mean_reward']):.4f} | " in version.description
    for heading in ("### Training", "### Reward-hacking monitors", "### Evaluation during training",
                    "### Known limits"):
        assert heading in version.description
    # The environment `reproduce` judges bit-identity by.
    assert tags["env.threads"] == "1" and tags["env.device"] == "cpu" and tags["env.cpu_capability"]


def test_fresh_process_loads_champion_and_completes(completed):
    code = ("import mlflow, pandas as pd, sys; "
            "m = mlflow.pyfunc.load_model('models:/grpo-addition@champion'); "
            "out = m.predict(pd.DataFrame({'prompt': ['12+30=', '5+5=']})); "
            "assert len(out) == 2 and all(isinstance(o, str) for o in out); print('COMPLETIONS', list(out))")
    proc = run([sys.executable, "-c", code], completed["repo"], env=completed["env"])
    assert "COMPLETIONS [" in proc.stdout


def test_reproduce_champion_reports_a_match(completed):
    proc = run([str(BIN / "grpo-pipeline"), "reproduce", "grpo-addition", "1"], completed["repo"],
               env=completed["env"], check=False)
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert "MATCH: weights and held-out metrics reproduced" in proc.stdout
    assert "OK  model weights md5" in proc.stdout and "OK  heldout data md5" in proc.stdout
    # The scratch re-run never touches the real registry.
    client = mlflow_client(completed["env"])
    assert [str(v.version) for v in client.search_model_versions("name = 'grpo-addition'")] == ["1"]


def test_reproduce_starts_the_recorded_commits_own_stage_server_in_either_layout(tmp_path):
    from pipelines.reproduce import stage_server_module

    # A version registered before components/ was split by role is re-run by its own commit's server.
    assert stage_server_module(ROOT) == "components.runtime.stage_server"
    (tmp_path / "components").mkdir()
    assert stage_server_module(tmp_path) is None  # older still: no server, DVC starts each stage
    (tmp_path / "components" / "stage_server.py").write_text("")
    assert stage_server_module(tmp_path) == "components.stage_server"


def test_run_logs_installed_packages(completed):
    client = mlflow_client(completed["env"])
    exp = client.get_experiment_by_name("grpo-pipeline")
    parent = next(r for r in client.search_runs([exp.experiment_id]) if r.data.tags.get("grpo.stage") == "pipeline")
    local = client.download_artifacts(parent.info.run_id, "environment/packages.txt", str(completed["repo"].parent))
    packages = Path(local).read_text().splitlines()
    assert any(p.startswith("torch==2.13.0") for p in packages) and any(p.startswith("mlflow==") for p in packages)


def test_prefect_markdown_artifact_has_table_and_decision(completed):
    db = Path(completed["env"]["PREFECT_HOME"]) / "prefect.db"
    rows = sqlite3.connect(db).execute("SELECT key, data FROM artifact WHERE key = 'grpo-pipeline-report'").fetchall()
    assert len(rows) == 1
    markdown = json.loads(rows[0][1]) if rows[0][1].startswith('"') else rows[0][1]
    assert "| baseline (before GRPO) |" in markdown and "| candidate (after GRPO) |" in markdown
    assert "**Decision:** version 1 of `grpo-addition` is **champion**" in markdown


def test_the_temporary_api_records_the_flow_run_without_heartbeats(completed):
    """The run's own temporary API stops with the CLI: no heartbeat thread to hold the flow's end."""
    db = sqlite3.connect(Path(completed["env"]["PREFECT_HOME"]) / "prefect.db")
    events = dict(db.execute("SELECT event, count(*) FROM events GROUP BY event").fetchall())
    assert events.get("prefect.flow-run.Running", 0) >= 1  # the API records this run's events at all
    assert "prefect.flow-run.heartbeat" not in events


def test_dvc_push_then_pull_into_a_fresh_clone_restores_data_and_models(completed, tmp_path):
    """A run is restorable from git + a DVC remote: cached outs (data, models, predictions) travel through
    `dvc push`/`dvc pull`; the small uncached metrics and plots are committed with dvc.lock. Training checkpoints
    are the resume state of unfinished runs, not an output: they stay where they were trained."""
    repo, env = completed["repo"], completed["env"]
    dvc = str(BIN / "dvc")
    run([dvc, "remote", "add", "-d", "storage", str(tmp_path / "dvc-remote")], repo)
    run(["git", "add", "-f", "dvc.lock", "params.yaml", ".dvc/config", "metrics", *map(str, repo.glob("plots/*.png"))],
        repo)
    run(["git", "commit", "-qm", "pipeline run"], repo)
    pushed = run([dvc, "push"], repo).stdout
    assert re.search(r"\d+ files? pushed", pushed), pushed
    clone = tmp_path / "clone"
    run(["git", "clone", "-q", str(repo), str(clone)], tmp_path)
    assert not (clone / "models").exists() and not (clone / "checkpoints").exists()
    run([dvc, "pull"], clone)
    restored = ["data/prepared/train.jsonl", "data/prepared/heldout.jsonl", "models/base/model.safetensors",
                "models/sft/model.safetensors", "models/grpo/model.safetensors", "eval/predictions.jsonl",
                "plots/grpo_steps.csv"]
    for rel in restored:
        assert (clone / rel).read_bytes() == (repo / rel).read_bytes(), rel
    assert not (clone / "checkpoints").exists()
    fresh = {**env, "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path / 'clone-store.db'}"}
    out = run([dvc, "repro"], clone, env=fresh).stdout
    assert ran_stages(out) == set() and "Data and pipelines are up to date." in out, out


def test_dvc_repro_is_up_to_date_then_kl_beta_reruns_only_downstream(completed):
    repo, env = completed["repo"], completed["env"]
    second = run([str(BIN / "dvc"), "repro"], repo, env=env)
    assert ran_stages(second.stdout) == set()
    assert "Data and pipelines are up to date." in second.stdout
    params = repo / "params.yaml"
    params.write_text(params.read_text().replace("kl_beta: 0.04", "kl_beta: 0.08"))
    third = dvc_repro_warm(repo, [], env)  # the stages that rerun skip their imports (the server is not under test)
    assert ran_stages(third.stdout) == {"grpo", "evaluate", "register"}
    client = mlflow_client(env)
    versions = client.search_model_versions("name = 'grpo-addition'")
    assert sorted(str(v.version) for v in versions) == ["1", "2"]
    assert str(client.get_model_version_by_alias("grpo-addition", "challenger").version) == "2"


def test_bad_dataset_stops_at_validate_and_leaves_registry_alone(completed):
    repo, env = completed["repo"], completed["env"]
    client = mlflow_client(env)
    before = sorted(str(v.version) for v in client.search_model_versions("name = 'grpo-addition'"))
    champion = client.get_model_version_by_alias("grpo-addition", "champion").version
    grpo_weights = (repo / "models" / "grpo" / "model.safetensors").read_bytes()
    before_run = tree_hashes(repo, USER_STATE)
    heldout_prompt = json.loads((repo / "data" / "prepared" / "heldout.jsonl").read_text().splitlines()[0])["prompt"]
    bad = [{"id": "a", "prompt": "1+2=", "answer": "3"}, {"id": "b", "prompt": "  ", "answer": "0"},
           {"id": "a", "prompt": "2+2=", "answer": "4"}, {"id": "c", "prompt": heldout_prompt, "answer": "1"}]
    (repo / "data" / "user" / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in bad))
    (repo / "data" / "user" / "heldout.jsonl").write_text((repo / "data" / "prepared" / "heldout.jsonl").read_text())
    cli = [str(BIN / "grpo-pipeline"), "run", "--set", "data.train_path=data/user/train.jsonl",
           "--set", "data.heldout_path=data/user/heldout.jsonl"]
    proc = run(cli, repo, env=env, check=False)
    out = proc.stdout
    assert proc.returncode != 0
    assert "data/user/train.jsonl" in out
    assert "rule 'prompt not empty or whitespace' failed" in out and "ids [b]" in out
    assert "rule 'unique ids' failed" in out and "ids [a, a]" in out
    assert "rule 'no prompt shared with held-out data' failed" in out and "ids [c]" in out
    # One report, printed once, no traceback on screen; the traceback is in the run's log file.
    assert out.count("error: validate: validation failed") == 1 and "Traceback" not in out, out
    assert out.count("rule 'unique ids' failed") == 2  # once per file: train.jsonl and its SFT copy
    logs = sorted((repo / "logs").glob("run-*.log"))
    assert logs and f"full log with the traceback: {logs[-1]}" in out and "Traceback" in logs[-1].read_text()
    assert not ran_stages(out) & {"sft", "grpo", "evaluate", "register"}
    assert sorted(str(v.version) for v in client.search_model_versions("name = 'grpo-addition'")) == before
    assert client.get_model_version_by_alias("grpo-addition", "champion").version == champion
    assert (repo / "models" / "grpo" / "model.safetensors").read_bytes() == grpo_weights
    # A failed run changes nothing the user had: params (its --set not applied), lock, data, models, metrics.
    after_run = tree_hashes(repo, USER_STATE)
    assert after_run == before_run, sorted(k for k in set(before_run) | set(after_run)
                                           if before_run.get(k) != after_run.get(k))
    assert "nothing the run changed was kept" in out
    kept = logs[-1].with_suffix("") / "validation.json"  # the failed run's own report, beside its log
    assert json.loads(kept.read_text())["success"] is False and f"its reports: {kept}" in out


def test_registration_is_never_restored_from_dvc_run_cache(completed, tmp_path):
    """With dvc.lock gone and a fresh tracking store, DVC may restore cached outputs, but it must
    really run `register`: a registration exists only where MLflow recorded it."""
    from mlflow.tracking import MlflowClient

    from pipelines.params_io import apply_to_params

    repo = completed["repo"]
    apply_to_params(repo / "params.yaml", [], ["data.train_path=null", "data.heldout_path=null"])  # undo the bad data
    (repo / "dvc.lock").unlink()
    env = {**completed["env"], "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path / 'fresh-store.db'}"}
    out = dvc_repro_warm(repo, ["register"], env).stdout
    assert "register" in ran_stages(out)
    versions = MlflowClient(tracking_uri=env["MLFLOW_TRACKING_URI"]).search_model_versions("name = 'grpo-addition'")
    assert len(versions) == 1
