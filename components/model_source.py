"""Where a model comes from: local directories, base-model pointers, hub ids, and their checks.

Kept free of torch and transformers so the CLI can check `model.name_or_path` (and name the
problem) in milliseconds, before any stage starts.
"""

from __future__ import annotations

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


def check_model_source(name_or_path: str, allow_download: bool) -> None:
    """Fail early, with the offline hint, unless the model is a usable local dir or an allowed hub id."""
    if not hub_download_allowed(name_or_path, allow_download):
        resolve_model_dir(name_or_path)


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
                    "(huggingface-cli download ID --local-dir DIR) and set model.name_or_path to DIR, or allow the "
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
