"""The tiny default written with torch alone is the checkpoint Hugging Face writes, byte for byte."""

import filecmp
import json
import subprocess
import sys

import pytest

from components.config import TinyModelConfig
from components.engine.modeling import build_char_tokenizer, build_tiny_model, count_parameters, save_model
from components.runtime.tiny_checkpoint import write_tiny_checkpoint
from conftest import ROOT

SHAPES = {"default": (TinyModelConfig(), 0),
          "other-shape-and-seed": (TinyModelConfig(hidden_size=64, num_layers=2, num_heads=2, intermediate_size=96,
                                                   max_position_embeddings=48), 123)}


@pytest.mark.parametrize("name", list(SHAPES))
def test_same_files_as_llama_save_pretrained(tmp_path, name):
    """Weights (the same random draws), config.json, generation_config.json and tokenizer files."""
    tiny, seed = SHAPES[name]
    tokenizer = build_char_tokenizer(["0123456789+= abc"])
    reference = build_tiny_model(tiny, tokenizer, seed)
    save_model(reference, tokenizer, tmp_path / "transformers")
    parameters = write_tiny_checkpoint(tiny, tokenizer, seed, tmp_path / "torch")

    names = sorted(path.name for path in (tmp_path / "transformers").iterdir())
    assert {"model.safetensors", "config.json", "generation_config.json"} <= set(names)
    assert sorted(path.name for path in (tmp_path / "torch").iterdir()) == names
    _, differing, unreadable = filecmp.cmpfiles(tmp_path / "transformers", tmp_path / "torch", names, shallow=False)
    assert (differing, unreadable) == ([], [])
    assert parameters == count_parameters(reference)


def test_model_stage_runs_without_transformers_modelling_code(tmp_path, mlflow_store):
    """`model` is served by the stage server's level without the Llama modelling import; it must not need it."""
    script = (
        "import sys\n"
        "from pathlib import Path\n"
        "from components.stages.model import build_base_model\n"
        "from components.config import load_config\n"
        "from components.data.paths import Paths\n"
        "from components.stages.prepare import prepare\n"
        "cfg, paths = load_config(sys.argv[1]), Paths(root=Path(sys.argv[2]))\n"
        "prepare(cfg, paths)\n"
        "build_base_model(cfg, paths)\n"
        "print(sorted(m for m in ('transformers.modeling_utils', 'transformers.models.llama.modeling_llama')"
        " if m in sys.modules))\n"
    )
    done = subprocess.run([sys.executable, "-c", script, str(ROOT / "params.yaml"), str(tmp_path / "work")],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "[]"
    base = tmp_path / "work" / "models" / "base"
    assert json.loads((base / "config.json").read_text())["model_type"] == "llama"
    assert json.loads((base / "provenance.json").read_text())["source"] == "tiny"
