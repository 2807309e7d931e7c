"""Operations on real servers: a `prefect server` and an `mlflow server` on 127.0.0.1 (one pair per module).

`grpo-pipeline serve` serves repository A with a short interval schedule and the data-update trigger;
`grpo-pipeline data update` emits the event; repository B runs through the same deployment with a
parameter override at the same moment, so two pipeline runs overlap and their `gpu` stages must
queue behind `grpo-pipeline setup`'s limit of 1. Afterwards: promote/rollback/compare through the
CLI against the MLflow server, the MLflow UI in headless Debian Chromium, `dvc plots show` offline,
and an MLflow server on a real PostgreSQL database.
"""

from __future__ import annotations

import html
import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from datetime import datetime
from pathlib import Path

import pytest

from conftest import BIN, FAST_PARAMS, ROOT, copy_project, run

pytestmark = [pytest.mark.integration, pytest.mark.slow]

MODEL = "grpo-addition"
ARTIFACTS = ROOT / "test-artifacts"
INTERVAL_S = 45
OPS_PARAMS = FAST_PARAMS + ["data.heldout_ratio=0.2", "reports.samples_every=3", "operations.retry_delay_s=2"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_http(url: str, proc: subprocess.Popen, what: str, timeout: float = 120) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"{what} exited with {proc.returncode}")
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise AssertionError(f"{what} did not answer at {url} within {timeout}s")


def start(cmd: list[str], log: Path, env: dict[str, str], cwd: Path | None = None) -> subprocess.Popen:
    """A server in its own session. Without the worker's shared stage server: the runs a served deployment starts
    each start their own, as a user's do, so two runs side by side never queue in one server."""
    from components.runtime.stage_server import SERVER_ENV

    inherited = {k: v for k, v in os.environ.items() if k != SERVER_ENV}
    return subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, env={**inherited, **env}, cwd=cwd,
                            start_new_session=True)


def stop(proc: subprocess.Popen, sig: int = signal.SIGINT, timeout: float = 30) -> None:
    """Stop a process we started (its own session), politely first."""
    if proc.poll() is not None:
        return
    os.killpg(proc.pid, sig)
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)


def mlflow_server(backend: str, artifacts: Path, log: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    proc = start([str(BIN / "mlflow"), "server", "--workers", "1", "--backend-store-uri", backend,
                  "--artifacts-destination", str(artifacts), "--host", "127.0.0.1", "--port", str(port)], log,
                 {"MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"})
    url = f"http://127.0.0.1:{port}"
    wait_http(f"{url}/health", proc, "mlflow server")
    return proc, url


@pytest.fixture(scope="module")
def servers(tmp_path_factory, prefect_home):
    tmp = tmp_path_factory.mktemp("servers")
    port = free_port()
    prefect_env = {"PREFECT_HOME": prefect_home(tmp / "prefect-home"), "PREFECT_UI_ENABLED": "false",
                   "PREFECT_SERVER_SERVICES_SCHEDULER_LOOP_SECONDS": "5",
                   "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
    prefect = start([str(BIN / "prefect"), "server", "start", "--host", "127.0.0.1", "--port", str(port)],
                    tmp / "prefect-server.log", prefect_env)
    try:
        mlflow, mlflow_url = mlflow_server(f"sqlite:///{tmp / 'mlflow.db'}", tmp / "mlartifacts", tmp / "mlflow.log")
        api = f"http://127.0.0.1:{port}/api"
        wait_http(f"{api}/health", prefect, "prefect server")
        env = {"PREFECT_API_URL": api, "MLFLOW_TRACKING_URI": mlflow_url, "PREFECT_HOME": str(tmp / "client-home"),
               "PREFECT_RUNNER_POLL_FREQUENCY": "2", "GRPO_ACTOR": "ops-test"}
        yield {"env": env, "api": api, "mlflow": mlflow_url, "tmp": tmp}
        stop(mlflow)
    finally:
        stop(prefect)


def api(servers, method: str, path: str, body: dict | None = None):
    import httpx

    for attempt in range(5):  # a busy SQLite-backed server answers 503 now and then; Prefect's client retries too
        response = httpx.request(method, servers["api"] + path, json=body, timeout=30)
        if response.status_code < 500 or attempt == 4:
            break
        time.sleep(1 + attempt)
    response.raise_for_status()
    return response.json()


def addition_records(n: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    pairs = rng.sample([(a, b) for a in range(100) for b in range(100)], n)
    return [{"id": f"u{i}", "prompt": f"{a}+{b}=", "answer": str(a + b)} for i, (a, b) in enumerate(pairs)]


def parse_time(value: str) -> datetime:
    return datetime.fromisoformat(value.replace("Z", "+00:00"))


@pytest.fixture(scope="module")
def served(servers):
    """Serve A; emit A's data event and start B's run through the deployment at once; wait for all runs."""
    from pipelines.params_io import apply_to_params

    tmp, env = servers["tmp"], servers["env"]
    incoming = tmp / "incoming" / "train.jsonl"
    incoming.parent.mkdir()
    incoming.write_text("".join(json.dumps(r) + "\n" for r in addition_records(420, 7)))
    repos = {}
    for name in ("A", "B"):
        repo = copy_project(tmp / name)
        apply_to_params(repo / "params.yaml", [], OPS_PARAMS)
        repos[name] = repo
    cli = str(BIN / "grpo-pipeline")
    setup = run([cli, "setup", "--root", str(repos["A"])], repos["A"], env=env).stdout
    # B gets the same data without an event (its run is started through the deployment below).
    run([cli, "data", "update", str(incoming), "--root", str(repos["B"]), "--no-emit"], repos["B"], env=env)
    serve = start([cli, "serve", "--root", str(repos["A"]), "--interval", str(INTERVAL_S), "--limit", "3"],
                  tmp / "serve.log", env, cwd=repos["A"])
    try:
        deployment = None
        deadline = time.monotonic() + 90
        while deployment is None and time.monotonic() < deadline:
            try:
                deployment = api(servers, "GET", "/deployments/name/grpo-pipeline/grpo-pipeline")
            except Exception:  # noqa: BLE001 - not registered yet
                time.sleep(1)
        assert deployment is not None, (tmp / "serve.log").read_text()[-3000:]
        # Prefect creates a deployment's trigger (an automation) just after the deployment itself.
        def data_trigger() -> list[dict]:
            automations = api(servers, "POST", "/automations/filter", {})
            return [a for a in automations if a["trigger"].get("expect") == ["grpo.dataset.updated"]]

        while not data_trigger() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert data_trigger(), api(servers, "POST", "/automations/filter", {})
        time.sleep(3)  # let the trigger be loaded by the server's triggers service
        started = time.time()
        event_out = run([cli, "data", "update", str(incoming), "--root", str(repos["A"])], repos["A"], env=env).stdout
        api(servers, "POST", f"/deployments/{deployment['id']}/create_flow_run",
            {"parameters": {"root": str(repos["B"]), "overrides": {"grpo.kl_beta": 0.08}}})
        runs = []
        deadline = time.monotonic() + 420
        while time.monotonic() < deadline:
            runs = api(servers, "POST", "/flow_runs/filter",
                       {"flow_runs": {"deployment_id": {"any_": [deployment["id"]]}}})
            done = [r for r in runs if r["state_type"] in ("COMPLETED", "FAILED", "CRASHED")]
            scheduled_done = [r for r in done if r["auto_scheduled"]]
            if len(done) >= 3 and scheduled_done and len([r for r in done if not r["auto_scheduled"]]) >= 2:
                break
            if any(r["state_type"] in ("FAILED", "CRASHED") for r in runs):
                break
            time.sleep(3)
        elapsed = time.time() - started
    finally:
        stop(serve)  # before the servers (a runner outliving its API ignores SIGTERM)
    runs = [r for r in runs if r["state_type"] in ("COMPLETED", "FAILED", "CRASHED")]
    ids = [r["id"] for r in runs]
    tasks = api(servers, "POST", "/task_runs/filter", {"flow_runs": {"id": {"any_": ids}}}) if ids else []
    print(f"served phase: {elapsed:.0f}s, {len(runs)} runs finished")
    return {"repos": repos, "deployment": deployment, "runs": runs, "tasks": tasks, "setup": setup,
            "event_out": event_out, "serve_log": (tmp / "serve.log").read_text()}


def test_served_deployment_runs_on_event_and_on_schedule(served):
    runs, log = served["runs"], served["serve_log"]
    assert runs and all(r["state_type"] == "COMPLETED" for r in runs), (
        [(r["name"], r["state_type"], r["state_name"]) for r in runs], log[-4000:])
    repo_a, repo_b = (str(served["repos"][n]) for n in ("A", "B"))
    by_event = [r for r in runs if not r["auto_scheduled"] and r["parameters"]["root"] == repo_a]
    scheduled = [r for r in runs if r["auto_scheduled"]]
    assert len(by_event) == 1 and (by_event[0]["created_by"] or {}).get("type") == "AUTOMATION", by_event
    assert scheduled and all(r["parameters"]["root"] == repo_a for r in scheduled)
    assert "event grpo.dataset.updated emitted" in served["event_out"]
    # The event's run trained on the copied file, recorded by DVC and pointed to by params.yaml.
    repo = served["repos"]["A"]
    assert (repo / "data" / "user" / "train.jsonl.dvc").exists()
    assert "train_path: data/user/train.jsonl" in (repo / "params.yaml").read_text()
    assert json.loads((repo / "metrics" / "eval.json").read_text())["n"] == 84  # 20% of the 420 records
    # The deployment parameter overrode the params key in B.
    by_param = [r for r in runs if r["parameters"]["root"] == repo_b]
    assert len(by_param) == 1
    assert "kl_beta: 0.08" in (served["repos"]["B"] / "params.yaml").read_text()


def test_two_overlapping_runs_never_train_at_once(served):
    assert "concurrency limit for tag 'gpu': 1" in served["setup"]
    runs = {r["id"]: r for r in served["runs"] if not r["auto_scheduled"]}
    assert len(runs) == 2
    a, b = runs.values()
    # The two pipeline runs really overlapped in time ...
    assert parse_time(a["start_time"]) < parse_time(b["end_time"]) and parse_time(b["start_time"]) < parse_time(
        a["end_time"])
    gpu = [t for t in served["tasks"] if "gpu" in t["tags"] and t["flow_run_id"] in runs]
    assert {t["name"].rsplit("-", 1)[0] for t in gpu} >= {"stage-sft", "stage-grpo", "stage-evaluate"}
    spans = sorted((parse_time(t["start_time"]), parse_time(t["end_time"]), t["flow_run_id"], t["name"]) for t in gpu)
    assert len({s[2] for s in spans}) == 2
    # ... but no two gpu-tagged task runs did.
    for (s1, e1, r1, n1), (s2, e2, r2, n2) in zip(spans, spans[1:]):
        assert s2 >= e1, f"{n1} ({r1}) and {n2} ({r2}) ran at once: {s1}..{e1} vs {s2}..{e2}"


def test_markdown_report_links_run_and_model_version(served, servers):
    artifacts = api(servers, "POST", "/artifacts/filter", {"artifacts": {"key": {"any_": ["grpo-pipeline-report"]}}})
    texts = [a["data"] for a in artifacts]
    assert len(texts) >= 2
    url = re.escape(servers["mlflow"])
    assert any(re.search(rf"\]\({url}/#/models/{MODEL}/versions/\d+\)", t) for t in texts), texts[0]
    assert all(re.search(rf"\]\({url}/#/experiments/\d+/runs/[0-9a-f]{{32}}\)", t) for t in texts)
    assert all("| baseline (before GRPO) |" in t and "**Decision:**" in t for t in texts)


def test_stages_are_tagged_only_where_the_tag_has_a_limit(servers):
    """An untagged stage skips Prefect's slot request, which a SQLite API answers 503 now and then (2 s retry)."""
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from pipelines.flow import tag_limit_exists

    with temporary_settings(updates={PREFECT_API_URL: servers["api"]}):
        assert not tag_limit_exists("grpo-test-no-limit")
        with get_client(sync_client=True) as client:
            assert str(client.api_url).rstrip("/") == servers["api"]
            client.create_concurrency_limit(tag="grpo-test-limited", concurrency_limit=2)
        assert tag_limit_exists("grpo-test-limited")


def test_deploy_registers_on_a_process_pool(servers, tmp_path):
    repo = copy_project(tmp_path / "repo")
    proc = run([str(BIN / "grpo-pipeline"), "deploy", "--pool", "grpo-process", "--name", "grpo-pooled",
                "--cron", "0 3 * * *", "--param", "grpo.kl_beta=0.06", "--root", str(repo)], repo, env=servers["env"])
    assert "registered on work pool 'grpo-process'" in proc.stdout
    assert api(servers, "GET", "/work_pools/grpo-process")["type"] == "process"
    dep = api(servers, "GET", "/deployments/name/grpo-pipeline/grpo-pooled")
    assert dep["work_pool_name"] == "grpo-process" and dep["entrypoint"] == "pipelines.flow.grpo_pipeline"
    assert dep["parameters"] == {"root": str(repo), "overrides": {"grpo.kl_beta": 0.06}}
    assert [s["schedule"]["cron"] for s in dep["schedules"]] == ["0 3 * * *"]
    bad = run([str(BIN / "grpo-pipeline"), "deploy", "--param", "grpo.kl_betta=1", "--root", str(repo)], repo,
              env=servers["env"], check=False)
    assert bad.returncode == 2 and "grpo.kl_betta: unknown key" in bad.stdout


def mlflow_client(servers):
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=servers["mlflow"])


def test_mlflow_holds_figures_sample_tables_and_predictions(served, servers):
    client = mlflow_client(servers)
    exp = client.get_experiment_by_name("grpo-pipeline")
    runs = client.search_runs([exp.experiment_id], filter_string="tags.`grpo.stage` = 'grpo'")
    assert len(runs) == 2
    run_id = runs[0].info.run_id
    figures = {a.path for a in client.list_artifacts(run_id, "figures")}
    assert figures == {"figures/grpo_reward.png", "figures/grpo_training.png", "figures/grpo_group_rewards.png",
                       "figures/grpo_heldout.png"}
    samples = {a.path for a in client.list_artifacts(run_id, "samples")}
    assert samples == {"samples/step_000003.json", "samples/step_000006.json"}
    local = client.download_artifacts(run_id, "samples/step_000003.json", str(servers["tmp"]))
    table = json.loads(Path(local).read_text())
    columns = table["columns"]
    assert {"step", "group", "prompt", "completion", "reward/exact_match", "reward", "advantage"} <= set(columns)
    rows = [dict(zip(columns, row)) for row in table["data"]]
    assert rows and all(re.fullmatch(r"\d+\+\d+=", r["prompt"]) for r in rows)
    # Advantages are the group-normalised rewards: they sum to ~0 within every group.
    for g in {r["group"] for r in rows}:
        assert abs(sum(r["advantage"] for r in rows if r["group"] == g)) < 1e-4
    evaluate = client.search_runs([exp.experiment_id], filter_string="tags.`grpo.stage` = 'evaluate'")[0]
    preds = json.loads(Path(client.download_artifacts(evaluate.info.run_id, "eval/heldout_predictions.json",
                                                      str(servers["tmp"] / "p"))).read_text())
    assert len(preds["data"]) == 84 and "candidate_completion" in preds["columns"]
    validate = client.search_runs([exp.experiment_id], filter_string="tags.`grpo.stage` = 'validate'")[0]
    docs = Path(client.download_artifacts(validate.info.run_id, "data_docs", str(servers["tmp"] / "d")))
    assert {p.name for p in docs.iterdir()} >= {"index.html", "train.html", "heldout.html"}
    assert "values must be unique" in (docs / "train.html").read_text()  # GX renders each rule as prose


def test_dvc_plots_render_offline(served, tmp_path):
    repo = served["repos"]["A"]
    run([str(BIN / "dvc"), "plots", "show", "-o", str(tmp_path / "plots")], repo)
    html = (tmp_path / "plots" / "index.html").read_text()
    assert not re.search(r"<(script|link|img)[^>]+(src|href)=[\"']?(https?:)?//", html), "loads a network resource"
    assert "https://" not in html and "http://" not in html
    for name in ("grpo_reward.png", "grpo_training.png", "grpo_group_rewards.png", "grpo_heldout.png"):
        assert name in html
    images = list((tmp_path / "plots").rglob("*.png"))
    assert len(images) == 4 and all(p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for p in images)


def chromium() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser")


def browse(url: str, profile: Path, *extra: str) -> subprocess.CompletedProcess:
    cmd = [chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
           "--disable-background-networking", "--disable-component-update", "--disable-sync",
           f"--user-data-dir={profile}", "--virtual-time-budget=15000", *extra, url]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120)


def test_mlflow_ui_shows_champion_and_heldout_metric(served, servers, tmp_path):
    if chromium() is None:
        pytest.skip("headless browser missing: install Debian's chromium (apt-get install -y chromium)")
    client = mlflow_client(servers)
    champion = client.get_model_version_by_alias(MODEL, "champion")
    model_page = f"{servers['mlflow']}/#/models/{MODEL}"
    dom = browse(model_page, tmp_path / "profile", "--dump-dom").stdout
    assert "champion" in dom and f"Version {champion.version}" in dom, dom[-2000:]
    version_dom = browse(f"{model_page}/versions/{champion.version}", tmp_path / "profile", "--dump-dom").stdout
    assert "champion" in version_dom
    assert "eval.heldout_mean_reward" in version_dom and champion.tags["eval.heldout_mean_reward"] in version_dom
    ARTIFACTS.mkdir(exist_ok=True)
    # The model page (tall enough that both versions' rows, with their aliases, are in view) and the
    # champion version's page (aliases and the held-out tags at the top).
    for name, url, size in (("mlflow-model-champion.png", model_page, "1400,2600"),
                            ("mlflow-model-champion-version.png", f"{model_page}/versions/{champion.version}",
                             "1400,1400")):
        shot = ARTIFACTS / name
        shot.unlink(missing_ok=True)
        browse(url, tmp_path / "profile", f"--screenshot={shot}", f"--window-size={size}")
        assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 20_000
    # The version page leads with its RL model card (the description, rendered Markdown), before the tags:
    # decision, held-out metrics with CIs, training, monitors, the held-out curve as a picture, limits.
    card_at = version_dom.find(f"Model card: {MODEL} v{champion.version}")
    assert 0 <= card_at < version_dom.find("eval.heldout_md5"), "model card not first"
    for heading in ("Held-out evaluation", "Reward-hacking monitors", "Evaluation during training", "Known limits"):
        assert heading in version_dom, heading
    assert "<table" in version_dom[card_at:version_dom.find("eval.heldout_md5")]  # tables rendered, not raw pipes
    image = re.search(r'<img[^>]+src="([^"]*get-artifact[^"]*)"', version_dom)
    assert image, "held-out curve missing from the rendered card"
    served_png = urllib.request.urlopen(servers["mlflow"] + "/" + html.unescape(image.group(1)).lstrip("/"), timeout=30)
    assert served_png.read()[:8] == b"\x89PNG\r\n\x1a\n"
    shot = ARTIFACTS / "mlflow-model-card.png"
    shot.unlink(missing_ok=True)
    browse(f"{model_page}/versions/{champion.version}", tmp_path / "profile", f"--screenshot={shot}",
           "--window-size=1400,2400")
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 20_000
    # The GRPO run's charts: one section per prefix, `learning/` (reward, KL, entropy, length) first,
    # then optim/, rollout/, time/; no single-value bar charts (the old final/* section) on top.
    grpo = client.search_runs([client.get_experiment_by_name("grpo-pipeline").experiment_id],
                              "tags.`grpo.stage` = 'grpo'", max_results=1)[0]
    charts = f"{servers['mlflow']}/#/experiments/{grpo.info.experiment_id}/runs/{grpo.info.run_id}/model-metrics"
    charts_dom = browse(charts, tmp_path / "profile", "--dump-dom", "--window-size=1400,1800").stdout
    # Section headers are in the DOM (the charts themselves are drawn; the screenshot shows them).
    at = {name: charts_dom.find(f">{name}<") for name in ("learning", "optim", "rollout", "time", "final")}
    assert at["final"] == -1, at
    assert 0 <= at["learning"] < at["optim"] < at["rollout"] < at["time"], at
    shot = ARTIFACTS / "mlflow-grpo-run-charts.png"
    shot.unlink(missing_ok=True)
    browse(charts, tmp_path / "profile", f"--screenshot={shot}", "--window-size=1400,1800")
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 20_000


def cli(served, servers, *args: str):
    return run([str(BIN / "grpo-pipeline"), *args, "--root", str(served["repos"]["A"])], served["repos"]["A"],
               env=servers["env"], check=False)


def test_promote_rollback_compare_against_the_server(served, servers):
    client = mlflow_client(servers)
    versions = {str(v.version): v for v in client.search_model_versions(f"name = '{MODEL}'")}
    assert set(versions) == {"1", "2"}
    assert versions["1"].tags["eval.heldout_md5"] == versions["2"].tags["eval.heldout_md5"]
    champion = str(client.get_model_version_by_alias(MODEL, "champion").version)
    other = "2" if champion == "1" else "1"
    proc = cli(served, servers, "promote", MODEL, other, "--reason", "canary looked good")
    assert proc.returncode == 0, proc.stdout
    assert f"champion moved from v{champion} to v{other} by ops-test" in proc.stdout
    assert str(client.get_model_version_by_alias(MODEL, "champion").version) == other
    tags = client.get_model_version(MODEL, other).tags
    assert tags["alias.champion.set_by"] == "ops-test" and tags["alias.champion.reason"] == "canary looked good"
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", tags["alias.champion.set_at"])
    model_tags = client.get_registered_model(MODEL).tags
    assert model_tags["champion.previous"] == champion
    audit = json.loads(model_tags["alias.audit"])
    assert audit[-1] == {**audit[-1], "alias": "champion", "from": champion, "to": other, "who": "ops-test",
                         "action": "promote"}
    assert {a["action"] for a in audit} >= {"register", "promote"}  # register's own moves are logged too

    proc = cli(served, servers, "rollback", MODEL, "--reason", "regression in prod")
    assert proc.returncode == 0, proc.stdout
    assert str(client.get_model_version_by_alias(MODEL, "champion").version) == champion
    assert client.get_model_version(MODEL, champion).tags["alias.champion.action"] == "rollback"
    proc = cli(served, servers, "rollback", MODEL)
    assert proc.returncode == 2 and "no previous champion to roll back to" in proc.stdout

    # Refusals: a version with no held-out evaluation, one evaluated on another held-out set, a missing one.
    source = versions["1"]
    model_id = source.model_id or source.source.removeprefix("models:/")
    bare = client.create_model_version(MODEL, source.source, run_id=source.run_id, model_id=model_id,
                                      tags={"registration": "complete"})
    other_set = client.create_model_version(MODEL, source.source, run_id=source.run_id, model_id=model_id, tags={
        "registration": "complete", "heldout_md5": "0" * 32, "heldout_mean_reward": "0.99"})
    proc = cli(served, servers, "promote", MODEL, str(bare.version))
    assert proc.returncode == 2 and "has no held-out evaluation" in proc.stdout
    proc = cli(served, servers, "promote", MODEL, str(other_set.version))
    assert proc.returncode == 2 and "evaluated on a different held-out dataset" in proc.stdout
    assert "0" * 32 in proc.stdout
    proc = cli(served, servers, "promote", MODEL, "99")
    assert proc.returncode == 2 and "version 99 of 'grpo-addition' does not exist" in proc.stdout
    assert str(client.get_model_version_by_alias(MODEL, "champion").version) == champion

    exp = client.get_experiment_by_name("grpo-pipeline")
    newest = client.search_runs([exp.experiment_id], filter_string="tags.`grpo.stage` = 'pipeline'",
                                order_by=["attributes.start_time DESC"])
    proc = cli(served, servers, "compare", "--last", "2")
    assert proc.returncode == 0, proc.stdout
    assert all(p.info.run_id[:12] in proc.stdout for p in newest[:2]), proc.stdout
    assert not any(p.info.run_id[:12] in proc.stdout for p in newest[2:]), proc.stdout
    # A's event run and B's run differ in kl_beta; the scheduled run may start before or after them.
    # Only finished runs: a scheduled run that began as the fixture stopped the runner has no metrics.
    by_beta = {p.data.params["grpo.kl_beta"]: p for p in reversed(newest) if p.info.status == "FINISHED"}
    parents = [by_beta["0.04"], by_beta["0.08"]]
    proc = cli(served, servers, "compare", *(p.info.run_id for p in parents))
    assert proc.returncode == 0, proc.stdout
    table = proc.stdout
    assert re.search(r"param grpo\.kl_beta\s+(0\.04\s+0\.08|0\.08\s+0\.04)", table), table
    assert "param task.n_train" not in table  # equal params are not listed
    for parent in parents:
        assert parent.info.run_id[:12] in table
        assert f"{parent.data.metrics['candidate_mean_reward']:.4f}" in table
        assert f"{parent.data.metrics['improvement_ci95_low']:+.4f}" in table
    assert re.search(r"data\.heldout\.md5\s+([0-9a-f]{12})\s+\1", table)
    assert re.search(r"duration\s+\d+\.\ds\s+\d+\.\ds", table)


# --------------------------------------------------------------------------- PostgreSQL


def postgres_bin() -> Path | None:
    found = shutil.which("initdb")
    if found:
        return Path(found).resolve().parent
    candidates = sorted(Path("/usr/lib/postgresql").glob("*/bin/initdb"))
    return candidates[-1].parent if candidates else None


@pytest.fixture
def postgres(tmp_path):
    bindir = postgres_bin()
    if bindir is None:
        pytest.skip("PostgreSQL missing: install Debian's postgresql (apt-get install -y postgresql)")
    pytest.importorskip("psycopg2", reason="psycopg2-binary missing: pip install -c constraints.txt -e '.[test]'")
    import tempfile

    base = Path(tempfile.mkdtemp(prefix="grpo-pg-"))  # not under pytest's 0700 temp root: postgres must reach it
    data, port = base / "pg", free_port()
    as_user: list[str] = []
    if os.geteuid() == 0:  # PostgreSQL refuses to run as root: use its own system user
        base.chmod(0o755)
        data.mkdir()
        shutil.chown(data, "postgres")
        as_user = ["runuser", "-u", "postgres", "--"]
    init = subprocess.run(as_user + [str(bindir / "initdb"), "-D", str(data), "-U", "mlflow", "--auth=trust",
                                     "-E", "UTF8"], capture_output=True, text=True)
    assert init.returncode == 0, init.stdout + init.stderr
    opts = f"-h 127.0.0.1 -p {port} -k {data}"
    subprocess.run(as_user + [str(bindir / "pg_ctl"), "-D", str(data), "-o", opts, "-l", str(data / "log"), "-w",
                              "start"], check=True, capture_output=True)
    try:
        import psycopg2

        conn = psycopg2.connect(host="127.0.0.1", port=port, user="mlflow", dbname="postgres")
        conn.autocommit = True
        conn.cursor().execute("CREATE DATABASE mlflow")
        conn.close()
        yield f"postgresql://mlflow@127.0.0.1:{port}/mlflow"
    finally:
        subprocess.run(as_user + [str(bindir / "pg_ctl"), "-D", str(data), "-m", "fast", "stop"], capture_output=True)
        shutil.rmtree(base, ignore_errors=True)


def test_mlflow_on_postgresql_registers_and_promotes(served, postgres, tmp_path):
    import psycopg2

    server, url = mlflow_server(postgres, tmp_path / "artifacts", tmp_path / "mlflow-pg.log")
    try:
        repo = tmp_path / "repo"
        shutil.copytree(served["repos"]["A"], repo, symlinks=True)
        env = {"MLFLOW_TRACKING_URI": url}
        # the stage as a pipeline run has it: forked by the worker's warm stage server (named in the environment)
        out = run([sys.executable, "-m", "components.runtime.launch", "register"], repo, env=env).stdout
        assert "register: models:/grpo-addition/1 -> champion (no champion yet (register.require_improvement" in out
        from mlflow.tracking import MlflowClient

        client = MlflowClient(tracking_uri=url)
        version = client.get_model_version_by_alias(MODEL, "champion")
        assert version.tags["registration"] == "complete"
        with psycopg2.connect(postgres) as conn, conn.cursor() as cur:
            cur.execute("SELECT alias, version FROM registered_model_aliases WHERE name = %s ORDER BY alias", (MODEL,))
            assert cur.fetchall() == [("challenger", 1), ("champion", 1)]
            cur.execute("SELECT value FROM model_version_tags WHERE name = %s AND key = 'eval.heldout_md5'", (MODEL,))
            assert cur.fetchone()[0] == json.loads((repo / "metrics" / "eval.json").read_text())["heldout_md5"]
    finally:
        stop(server)
