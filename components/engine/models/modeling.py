"""Build or load the policy model and tokenizer; seeding and device choice.

The embedded default is a tiny Llama plus a character-level tokenizer built offline from the
characters of the datasets in use, so it also fits a user's own small-alphabet task. Any local
Hugging Face directory replaces it through `model.name_or_path`.
"""

from __future__ import annotations

import json
import os
import random
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch

from components.config import PipelineConfig, TinyModelConfig
from components.data.model_source import (  # noqa: F401 - re-exported
    POINTER_FILE,
    ModelLoadError,
    check_model_source,
    context_length,
    hub_download_allowed,
    load_tokenizer,
    resolve_model_dir,
    write_pointer,
)

SPECIAL_TOKENS = {"pad": "<pad>", "bos": "<bos>", "eos": "<eos>", "unk": "<unk>"}


def seed_everything(seed: int, threads: int = 0) -> None:
    """Seed Python, NumPy and torch, pin the thread count and ask torch for deterministic kernels.

    Deterministic mode would also fill every `torch.empty` with NaN, a guard against reading memory
    never written, which no result here depends on: off, as PyTorch's docs allow for valid programs
    (1,300 fills per tiny-default GRPO step, among them the decoder's KV buffers; see docs/performance.md).
    On CUDA, cuBLAS's products are deterministic only with a fixed workspace (`CUBLAS_WORKSPACE_CONFIG`, read when
    its handle is made): set here, before any product, unless the user set it; it changes nothing on the CPU.
    """
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    if threads > 0:
        torch.set_num_threads(threads)
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.utils.deterministic.fill_uninitialized_memory = False


_SAID_NO_GPU: list[bool] = []


def pick_device(requested: str) -> torch.device:
    """`auto` -> CUDA when present, else CPU; an explicit `cuda` without a GPU is an error. `auto` with a CUDA build
    of torch that sees no GPU (a driver or `CUDA_VISIBLE_DEVICES` problem on a GPU machine) says so once a process
    before it goes on on the CPU: a run that should take minutes on the card would otherwise take hours silently."""
    if requested == "cuda" and not torch.cuda.is_available():
        raise ModelLoadError("device: 'cuda' requested but no CUDA device is available")
    if requested == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        if torch.version.cuda and not _SAID_NO_GPU:
            _SAID_NO_GPU.append(True)
            print(f"device: torch {torch.__version__} is a CUDA {torch.version.cuda} build but sees no GPU "
                  "(driver, CUDA_VISIBLE_DEVICES?): running on the CPU; device=cuda makes this an error", flush=True)
        return torch.device("cpu")
    return torch.device(requested)


def build_char_tokenizer(texts: Iterable[str]):
    """A `PreTrainedTokenizerFast` with one token per character seen in `texts` (plus specials)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = sorted({ch for text in texts for ch in text})
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS.values())}
    for ch in chars:
        vocab.setdefault(ch, len(vocab))
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token=SPECIAL_TOKENS["unk"]))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    backend.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, padding_side="left",
        **{f"{k}_token": v for k, v in SPECIAL_TOKENS.items()},
    )


def build_tiny_model(tiny: TinyModelConfig, tokenizer, seed: int):
    """A randomly initialised Llama sized by `tiny`, with tied embeddings."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=tiny.hidden_size, num_hidden_layers=tiny.num_layers,
        num_attention_heads=tiny.num_heads, num_key_value_heads=tiny.num_heads,
        intermediate_size=tiny.intermediate_size, max_position_embeddings=tiny.max_position_embeddings,
        tie_word_embeddings=True, pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(config)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """`auto`: bfloat16 on a GPU that supports it, float32 otherwise (CPU matmuls are fastest in fp32)."""
    if name == "auto":
        bf16 = device.type == "cuda" and torch.cuda.is_bf16_supported()
        return torch.bfloat16 if bf16 else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


ADAPTER_CONFIG = "adapter_config.json"


def adapter_base(path: str | Path) -> Path | None:
    """The model a LoRA adapter directory was trained on (recorded by the GRPO stage), or None for a
    full model directory."""
    path = Path(path)
    if not (path / ADAPTER_CONFIG).exists():
        return None
    provenance = path / "provenance.json"
    base = json.loads(provenance.read_text()).get("base_model") if provenance.exists() else None
    if not base:
        raise ModelLoadError(f"{path}: a LoRA adapter without provenance.json 'base_model': its base is unknown")
    return Path(base)


def load_model(path: str | Path, device: torch.device, dtype: torch.dtype = torch.float32,
               trust_remote_code: bool = False):
    """Load a causal LM from safetensors only (`use_safetensors=True`), in eval mode on `device`.
    A LoRA adapter directory loads as its base with the adapter merged in (a plain model to evaluate)."""
    from transformers import AutoModelForCausalLM

    base = adapter_base(path)
    source = resolve_model_dir(base if base is not None else path)
    model = AutoModelForCausalLM.from_pretrained(str(source), dtype=dtype, use_safetensors=True,
                                                 trust_remote_code=trust_remote_code)
    if base is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, str(path)).merge_and_unload()
    return model.to(device).eval()


def load_policy_model(cfg: PipelineConfig, path: str | Path, device: torch.device):
    """`load_model` with the dtype and remote-code settings of `cfg.model`."""
    return load_model(path, device, resolve_dtype(cfg.model.dtype, device), cfg.model.trust_remote_code)


# Loading options that transformers copies into tokenizer_config.json: they describe the environment
# a stage ran in (HF_HUB_OFFLINE=1 sets local_files_only), not the tokenizer, and would make the same
# training give different output hashes under `make run` and a plain `dvc repro`.
ENVIRONMENT_KEYS = ("local_files_only", "cache_dir", "token", "use_auth_token", "force_download", "proxies")


def save_tokenizer(tokenizer, out_dir: Path) -> None:
    """`save_pretrained`, then drop the loading options that record the environment, not the tokenizer."""
    tokenizer.save_pretrained(str(out_dir))
    config_file = out_dir / "tokenizer_config.json"
    if config_file.exists():
        config = json.loads(config_file.read_text())
        if any(key in config for key in ENVIRONMENT_KEYS):
            for key in ENVIRONMENT_KEYS:
                config.pop(key, None)
            config_file.write_text(json.dumps(config, indent=2, sort_keys=True, ensure_ascii=False) + "\n")


def save_model(model, tokenizer, out_dir: Path, extra: dict[str, Any] | None = None) -> None:
    """Save an HF checkpoint (safetensors) plus an optional JSON of provenance."""
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out_dir), safe_serialization=True)
    save_tokenizer(tokenizer, out_dir)
    if extra is not None:
        write_provenance(out_dir, extra)


def write_provenance(out_dir: Path, extra: dict[str, Any]) -> None:
    """Where a saved model came from (stage, steps, source), beside its weights."""
    (out_dir / "provenance.json").write_text(json.dumps(extra, indent=2, sort_keys=True) + "\n")


def count_parameters(model) -> int:
    return sum(p.numel() for p in model.parameters())


def base_model_source(cfg: PipelineConfig) -> str:
    """What the `model` stage starts from, for logs: the tiny default or the user's directory."""
    return cfg.model.name_or_path or "tiny-llama (built offline from params)"


def checkpointable_layers(model: Any) -> list[Any]:
    """The Hugging Face decoder layers that can recompute themselves in backward (`GradientCheckpointingLayer`)."""
    try:
        from transformers.modeling_layers import GradientCheckpointingLayer
    except ImportError:  # older or newer transformers without it: no checkpointing on the plain path
        return []
    return [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]


@contextmanager
def layer_checkpointing(model: Any, enabled: bool) -> Iterator[None]:
    """Forwards inside keep each decoder layer's input only and recompute the layer in backward.

    Only inside: Hugging Face drops the KV cache of a checkpointing layer in train mode, which would break
    cached sampling, so it is switched on around the training forward alone (the backward replays the saved
    function, whatever the flag is by then). Outside a gradient it does nothing.
    """
    layers = checkpointable_layers(model) if enabled and torch.is_grad_enabled() else []
    from torch.utils.checkpoint import checkpoint

    for layer in layers:
        layer.gradient_checkpointing = True
        layer._gradient_checkpointing_func = partial(checkpoint, use_reentrant=False)
    try:
        yield
    finally:
        for layer in layers:
            del layer.gradient_checkpointing  # back to the class default (off)
