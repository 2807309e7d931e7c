"""Same commit, data and params -> same bytes: GRPO determinism, the lock file, two fresh clones."""

import random
import re
import tomllib

import numpy as np
import pytest
import torch
import yaml
from packaging.requirements import Requirement
from packaging.version import Version

from components.config import load_config
from components.data.paths import Paths
from components.engine.generation.engines.base import SamplingParams
from components.stages.grpo import train_grpo
from components.stages.model import build_base_model
from components.stages.prepare import prepare
from components.stages.sft import train_sft
from tests.engine.sampling import sample_texts

from conftest import FAST_PARAMS, ROOT, committed_params, copy_committed_project, dvc_repro_warm

SMALL = ["task.n_sft=200", "task.n_train=200", "task.n_heldout=50", "sft.epochs=2", "grpo.steps=5",
         "grpo.prompts_per_step=4", "grpo.group_size=4", "grpo.checkpoint_every=0", "grpo.kl_beta=0.05",
         "threads=1"]


def train(root, callbacks=()):
    cfg = load_config(committed_params(), SMALL)
    paths = Paths(root=root)
    prepare(cfg, paths)
    build_base_model(cfg, paths)
    train_sft(cfg, paths)
    train_grpo(cfg, paths, callbacks=callbacks)
    return (paths.grpo_model / "model.safetensors").read_bytes()


def test_grpo_weights_are_byte_identical_even_with_extra_evaluation(tmp_path, mlflow_store):
    first = train(tmp_path / "a")
    second = train(tmp_path / "b")
    assert first == second

    def noisy_evaluation(step, policy, metrics):
        # Consumes every global RNG and runs the policy, as an evaluation or logging hook would.
        torch.rand(1000), random.random(), np.random.rand(10)
        modeling = __import__("components.engine.models.modeling", fromlist=["load_tokenizer"])
        tok = modeling.load_tokenizer(tmp_path / "c" / "models" / "sft")
        sample_texts(policy, tok, ["1+2=", "30+4="], SamplingParams(n=2, max_new_tokens=4))  # the global generator

    assert train(tmp_path / "c", callbacks=[noisy_evaluation]) == first


def _pins():
    pins = {}
    for line in (ROOT / "requirements.lock").read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            name, _, version = line.partition("==")
            pins[re.sub(r"[-_.]+", "-", name).lower()] = version
    return pins


def test_lock_file_satisfies_pyproject():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    requirements = project["dependencies"] + project["optional-dependencies"]["test"]
    pins = _pins()
    assert pins["torch"] == "2.13.0"
    for text in requirements:
        req = Requirement(text)
        name = re.sub(r"[-_.]+", "-", req.name).lower()
        assert name in pins, f"{req.name} is in pyproject.toml but not in requirements.lock (run make lock)"
        assert req.specifier.contains(Version(pins[name]), prereleases=True), \
            f"requirements.lock pins {name}=={pins[name]}, outside pyproject's {req.specifier} (run make lock)"


def test_make_targets_install_from_the_lock():
    makefile = (ROOT / "Makefile").read_text()
    setup_recipe = makefile.split("$(VENV)/.installed:")[1].split("\n\n")[0]
    assert "-r requirements.lock" in setup_recipe and "requirements.lock" in setup_recipe.splitlines()[0]
    assert re.search(r"^run: setup", makefile, re.M) and re.search(r"^test: setup", makefile, re.M)


@pytest.mark.slow
def test_two_fresh_clones_give_identical_dvc_lock_hashes(tmp_path, monkeypatch):
    """One clone as `make run` runs it (HF_HUB_OFFLINE=1 ...), one as a plain shell's `dvc repro --force`
    without those variables: outputs must not record the environment they ran in (transformers copies
    `local_files_only` into tokenizer_config.json when offline), so every hash is the same."""
    from pipelines.params_io import apply_to_params

    locks = []
    for name, make_env in (("make", True), ("shell", False)):
        if not make_env:
            for key in ("HF_HUB_OFFLINE", "TOKENIZERS_PARALLELISM"):
                monkeypatch.delenv(key, raising=False)
        repo = copy_committed_project(tmp_path / name)
        apply_to_params(repo / "params.yaml", [], FAST_PARAMS)
        dvc_repro_warm(repo, ["--force"], {"MLFLOW_TRACKING_URI": f"sqlite:///{repo / 'mlflow.db'}"})
        stages = yaml.safe_load((repo / "dvc.lock").read_text())["stages"]
        locks.append({out["path"]: out["md5"] for stage in stages.values() for out in stage.get("outs", [])})
        if make_env:
            assert '"local_files_only"' not in (repo / "models" / "sft" / "tokenizer_config.json").read_text()
    # Wall-clock columns make the step-metrics plot differ; every data and model output must not.
    for outs in locks:
        outs.pop("plots/grpo_steps.csv")
    assert {"data/prepared", "models/base", "models/sft", "models/grpo"} <= set(locks[0])
    assert locks[0] == locks[1]
