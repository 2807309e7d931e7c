"""The README's commands, run as shown: serving the champion and calling it (after a real pipeline run), the reward
function a user copies into a module of theirs and names in params.yaml, and the troubleshooting section's fixes.
The Quick start has its own test (tests/test_quick_start.py)."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from conftest import BIN, FAST_PARAMS, ROOT, copy_committed_project, free_port, run


def readme_blocks(title: str) -> list[tuple[str, str]]:
    """(language, text) of each fenced block of the README section whose heading starts with `title`."""
    readme = (ROOT / "README.md").read_text()
    start = readme.index(f"## {title}")
    end = readme.find("\n## ", start + 3)
    return re.findall(r"^```(\w*)\n(.*?)^```$", readme[start:end if end != -1 else None], re.S | re.M)


def bash_commands(block: str) -> list[str]:
    """A bash block's commands, continuation lines joined, comments dropped."""
    joined = re.sub(r"\\\n\s*", "", block)
    return [line.split("  #")[0].strip() for line in joined.splitlines() if line.strip()]


def _env(repo: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}  # the repository's own mlflow.db
    return {**env, "PATH": f"{BIN}{os.pathsep}{env['PATH']}"}


@pytest.mark.slow
@pytest.mark.integration
def test_serving_the_champion_answers_as_the_readme_shows(tmp_path):
    import mlflow
    import pandas as pd

    (language, commands), (_, shown) = readme_blocks("Serve the champion")[:2]
    serve, call = bash_commands(commands)
    assert language == "bash" and serve.startswith("mlflow models serve -m models:/grpo-addition@champion")
    repo = copy_committed_project(tmp_path / "repo")
    env = _env(repo)
    run([str(BIN / "grpo-pipeline"), "run", *[x for o in FAST_PARAMS for x in ("--set", o)]], repo, env=env)

    port = str(free_port())
    serve, call = (c.replace("5001", port) for c in (serve.rstrip(" &"), call))
    server = subprocess.Popen(["bash", "-c", f"exec {serve}"], cwd=repo, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        deadline, answer = time.time() + 240, None
        while answer is None and time.time() < deadline and server.poll() is None:
            proc = subprocess.run(["bash", "-c", call], cwd=repo, env=env, capture_output=True, text=True)
            answer = json.loads(proc.stdout) if proc.returncode == 0 and proc.stdout.strip() else None
            time.sleep(0 if answer else 1)
        assert answer is not None, server.stdout.read() if server.poll() is not None else "no answer"
    finally:
        os.killpg(server.pid, signal.SIGINT)
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
    expected = json.loads(shown)
    assert answer.keys() == expected.keys() and len(answer["predictions"]) == len(expected["predictions"])
    prompts = [r["prompt"] for r in json.loads(re.search(r"-d '(.*)'", call).group(1))["dataframe_records"]]
    mlflow.set_tracking_uri(f"sqlite:///{repo / 'mlflow.db'}")
    loaded = mlflow.pyfunc.load_model("models:/grpo-addition@champion")
    assert answer["predictions"] == list(loaded.predict(pd.DataFrame({"prompt": prompts})))


def test_the_readme_reward_function_scores_and_a_dry_run_trains_with_it(tmp_path):
    blocks = readme_blocks("Your own data, model and reward")
    code = next(text for language, text in blocks if language == "python")
    settings = next(text for language, text in blocks if language == "yaml")
    commands = next(text for language, text in blocks if language == "bash")
    module = re.match(r"# (\w+\.py)", code).group(1)
    repo = copy_committed_project(tmp_path / "repo")
    (repo / module).write_text(code)
    from pipelines.params_io import apply_to_params

    (tmp_path / "settings.yaml").write_text(settings)
    sys.path.insert(0, str(repo))
    try:
        apply_to_params(repo / "params.yaml", [tmp_path / "settings.yaml"], [])  # what editing params.yaml does
        name = yaml.safe_load(settings)["grpo"]["rewards"][0]["name"]
        fn = getattr(__import__(name.split(":")[0]), name.split(":")[1])
    finally:
        sys.path.remove(str(repo))
    # hand-computed: exact, off by one, off by two, no number, no answer
    assert fn(["1+1="] * 5, ["2", " 3", "4", "two", "2"], ["2", "2", "2", "2", None]) == [1.0, 0.5, 0.0, 0.0, None]
    proc = run(["bash", "-c", "set -e\n" + "\n".join(bash_commands(commands))], repo, env=_env(repo), check=False)
    assert proc.returncode == 0 and "dry run: config, data and model valid" in proc.stdout, proc.stdout[-3000:]
    assert "nothing was trained or written" in proc.stdout and not (repo / "models").exists()


MAKE_FILES = ["Makefile", "requirements.lock", "constraints.txt", "pyproject.toml", "install/torch.sh"]


def _make_copy(folder: Path) -> Path:
    for rel in MAKE_FILES:
        (folder / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / rel, folder / rel)
    return folder


def test_a_half_made_venv_is_refused_naming_the_readme_fix(tmp_path):
    (language, block), = readme_blocks("Troubleshooting")[:1]
    remove, install, again = bash_commands(block)
    folder = _make_copy(tmp_path)
    python = str(Path(sys.base_prefix) / "bin" / "python3")
    subprocess.run([python, "-m", "venv", "--without-pip", ".venv"], cwd=folder, check=True)  # what Debian leaves
    version = f"{sys.version_info[0]}.{sys.version_info[1]}"
    proc = subprocess.run(["make", "setup"], cwd=folder, capture_output=True, text=True, timeout=120)
    said = [line for line in proc.stderr.splitlines() if line.startswith("make: .venv")]
    assert proc.returncode != 0 and len(said) == 1, proc.stdout + proc.stderr
    assert "half-made (no pip)" in said[0] and remove in said[0] and f"python{version}-venv" in said[0]
    assert re.fullmatch(r"sudo apt-get install python3\.1[12]-venv", install)  # the README's example, one version
    subprocess.run(["bash", "-c", remove], cwd=folder, check=True)
    assert not (folder / ".venv").exists() and again == "make run"


def test_torch_cpu_replaces_an_installed_cuda_build(tmp_path):
    (_, block) = readme_blocks("Troubleshooting")[1]
    switch = bash_commands(block)[0]
    folder = _make_copy(tmp_path)
    (folder / ".venv" / "bin").mkdir(parents=True)
    (folder / ".venv" / "bin" / "python").symlink_to(sys.executable)
    (folder / ".venv" / ".torch-cuda").touch()
    (folder / ".venv" / ".installed").touch()
    plan = subprocess.run(["make", "-n", *switch.split()[1:]], cwd=folder, capture_output=True, text=True,
                          timeout=60)
    assert plan.returncode == 0 and "sh install/torch.sh cpu" in plan.stdout, plan.stdout + plan.stderr
    kept = subprocess.run(["make", "-n", "run"], cwd=folder, capture_output=True, text=True, timeout=60).stdout
    assert "install/torch.sh" not in kept  # without TORCH=, the installed build stays


def test_device_cuda_stops_in_one_line_without_a_visible_gpu(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is visible here")
    (_, block) = readme_blocks("Troubleshooting")[1]
    check = bash_commands(block)[1]
    repo = copy_committed_project(tmp_path / "repo")
    proc = run(["bash", "-c", check], repo, env=_env(repo), check=False)
    errors = [line for line in proc.stdout.splitlines() if line.startswith("error:")]
    assert proc.returncode != 0 and errors == ["error: device: 'cuda' requested but no CUDA device is available"], \
        proc.stdout[-2000:]
    assert not any(line.startswith(("prepare:", "validate:")) for line in proc.stdout.splitlines()), \
        "the device was checked only after the data was prepared and validated"
