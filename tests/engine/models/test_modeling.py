"""The tokenizer and tiny model, loading and saving models, refusing unsafe or missing ones."""

import os

import pytest
import torch

from components.engine.models.modeling import (
    ModelLoadError,
    count_parameters,
    load_model,
    load_tokenizer,
    resolve_model_dir,
    seed_everything,
)
from tests.engine.sampling import TEXTS, saved_tiny_model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return saved_tiny_model(tmp_path_factory.mktemp("tiny"))


def test_char_tokenizer_roundtrips_and_pads_left(tiny):
    tok = load_tokenizer(tiny)
    ids = tok("12+34=", add_special_tokens=False).input_ids
    assert len(ids) == 6 and tok.decode(ids) == "12+34="
    assert len(tok) == 4 + len(set("".join(TEXTS)))
    batch = tok(["1+1=", "12+34="], padding=True, add_special_tokens=False)
    assert batch.attention_mask[0][:2] == [0, 0]  # left padding


def test_tiny_model_size_in_range(tiny):
    n = count_parameters(load_model(tiny, torch.device("cpu")))
    assert 500_000 <= n <= 3_000_000


def test_seed_everything_keeps_deterministic_kernels_without_filling_empty_tensors(monkeypatch):
    """Deterministic algorithms stay on (the two-clone reproducibility test relies on them), with the fixed cuBLAS
    workspace CUDA needs for them (a user's own setting kept); the NaN fill of `torch.empty`, a debugging guard that
    cost ~1 ms of a tiny-default step, is off."""
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    before = torch.are_deterministic_algorithms_enabled(), torch.utils.deterministic.fill_uninitialized_memory
    torch.use_deterministic_algorithms(False)
    torch.utils.deterministic.fill_uninitialized_memory = True
    try:
        seed_everything(0)
        assert torch.are_deterministic_algorithms_enabled()
        assert not torch.utils.deterministic.fill_uninitialized_memory
        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
        monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":16:8")
        seed_everything(0)
        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":16:8"
    finally:
        torch.use_deterministic_algorithms(before[0], warn_only=True)
        torch.utils.deterministic.fill_uninitialized_memory = before[1]


def test_pickle_weights_are_refused(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    torch.save({"w": torch.zeros(1)}, tmp_path / "pytorch_model.bin")
    with pytest.raises(ModelLoadError, match="pickle files; only safetensors"):
        resolve_model_dir(tmp_path)


def test_missing_model_path_mentions_offline_download(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelLoadError, match="download it first"):
        resolve_model_dir("Qwen/Qwen2.5-0.5B-Instruct")


def test_hub_id_is_used_only_when_allowed_and_online(tmp_path, monkeypatch):
    from components.engine.models.modeling import check_model_source, hub_download_allowed, write_pointer

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert not hub_download_allowed("Qwen/Qwen2.5-0.5B-Instruct", allow_download=True)
    with pytest.raises(ModelLoadError, match="model.allow_download: true and HF_HUB_OFFLINE=0"):
        check_model_source("Qwen/Qwen2.5-0.5B-Instruct", allow_download=True)
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    with pytest.raises(ModelLoadError, match="does not exist"):
        check_model_source("Qwen/Qwen2.5-0.5B-Instruct", allow_download=False)
    check_model_source("Qwen/Qwen2.5-0.5B-Instruct", allow_download=True)  # allowed: no error, nothing fetched yet
    write_pointer(tmp_path / "base", "Qwen/Qwen2.5-0.5B-Instruct", hub=True)
    assert str(resolve_model_dir(tmp_path / "base")) == "Qwen/Qwen2.5-0.5B-Instruct"


def test_a_cuda_build_that_sees_no_gpu_says_so_once_before_running_on_the_cpu(monkeypatch, capsys):
    import components.engine.models.modeling as modeling

    monkeypatch.setattr(modeling, "_SAID_NO_GPU", [])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    assert modeling.pick_device("auto") == torch.device("cpu")
    assert modeling.pick_device("auto") == torch.device("cpu")
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 1 and "is a CUDA 12.8 build but sees no GPU" in lines[0] and "device=cuda" in lines[0]
    with pytest.raises(ModelLoadError, match="'cuda' requested but no CUDA device"):
        modeling.pick_device("cuda")
    monkeypatch.setattr(torch.version, "cuda", None)  # the CPU build: nothing to say
    monkeypatch.setattr(modeling, "_SAID_NO_GPU", [])
    assert modeling.pick_device("auto") == torch.device("cpu") and capsys.readouterr().out == ""
