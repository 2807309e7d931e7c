"""What the registry stores for a trained model: the full model, or a LoRA adapter linked to its base.

A LoRA adapter is a few MB; its base (hundreds of MB) is registered once, as `<model_name>-base`,
keyed by the base directory's hash, and every adapter version names it (`base_model_uri`) and carries
its source and hashes as tags. Loading `models:/NAME@champion` in a fresh process loads the base version
and applies the adapter (components/tracking/serving_model.py). `register.merge_lora: true` registers the merged
model instead, as self-contained as a full fine-tune.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from components.data.records import dir_md5
from components.engine.models.modeling import adapter_base, resolve_model_dir

SERVING_MODULE = Path(__file__).with_name("serving_model.py")
PIP_REQUIREMENTS = ["torch", "transformers", "safetensors", "pandas"]
ADAPTER_PIP_REQUIREMENTS = PIP_REQUIREMENTS + ["peft"]


def _signature():
    from mlflow.models import ModelSignature
    from mlflow.types import ColSpec, Schema

    return ModelSignature(inputs=Schema([ColSpec("string", "prompt")]), outputs=Schema([ColSpec("string")]))


def log_completion_model(model_dir: Path, model_config: dict[str, Any], requirements: list[str]):
    """Log `model_dir` as the pyfunc completion model in the active run; returns MLflow's ModelInfo."""
    import mlflow

    return mlflow.pyfunc.log_model(name="model", python_model=str(SERVING_MODULE),
                                   artifacts={"model_dir": str(model_dir)}, pip_requirements=requirements,
                                   model_config=model_config, signature=_signature())


def base_provenance(base_dir: Path) -> dict[str, str]:
    """Source and hashes of a base model directory (the GGUF's sha256 when it was converted from one)."""
    provenance = base_dir / "provenance.json"
    recorded = json.loads(provenance.read_text()) if provenance.exists() else {}
    tags = {"base.source": str(recorded.get("source", base_dir)), "base.md5": dir_md5(base_dir)}
    if recorded.get("gguf_sha256"):
        tags["base.gguf_sha256"] = recorded["gguf_sha256"]
    return tags


def ensure_base_version(client, name: str, base_dir: Path, model_config: dict[str, Any]) -> tuple[str, dict[str, str]]:
    """`models:/<name>-base/<v>` holding `base_dir`, registering it the first time this hash is seen."""
    import mlflow

    base_name = f"{name}-base"
    tags = base_provenance(base_dir)
    if client.search_registered_models(filter_string=f"name = '{base_name}'"):
        for version in client.search_model_versions(f"name = '{base_name}'"):
            if version.tags.get("base.md5") == tags["base.md5"] and version.tags.get("registration") == "complete":
                return f"models:/{base_name}/{version.version}", tags
    else:
        client.create_registered_model(base_name, description=f"Base models of the LoRA adapters in {name}.")
    run = mlflow.active_run()
    info = log_completion_model(base_dir, model_config, PIP_REQUIREMENTS)
    version = client.create_model_version(base_name, info.model_uri, run_id=run.info.run_id if run else None,
                                          tags=tags, model_id=info.model_id)
    client.set_model_version_tag(base_name, version.version, "registration", "complete")
    print(f"register: base model {tags['base.source']} registered once as models:/{base_name}/{version.version}")
    return f"models:/{base_name}/{version.version}", tags


@contextmanager
def merged_copy(adapter_dir: Path) -> Iterator[Path]:
    """A temporary full checkpoint: the adapter merged into its base (for `register.merge_lora`)."""
    import torch

    from components.engine.models.modeling import load_model, save_model

    tmp = Path(tempfile.mkdtemp(prefix="grpo-merged-"))
    try:
        from components.data.model_source import load_tokenizer

        save_model(load_model(adapter_dir, torch.device("cpu")), load_tokenizer(adapter_dir), tmp / "model")
        yield tmp / "model"
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def log_trained_model(client, name: str, model_dir: Path, model_config: dict[str, Any], merge_lora: bool):
    """Log models/grpo for registration; returns (ModelInfo, extra version tags)."""
    base = adapter_base(model_dir)
    if base is None:
        return log_completion_model(model_dir, model_config, PIP_REQUIREMENTS), {"model.kind": "full"}
    base_dir = resolve_model_dir(base)
    if merge_lora:
        with merged_copy(model_dir) as merged:
            info = log_completion_model(merged, model_config, PIP_REQUIREMENTS)
        return info, {"model.kind": "lora-merged", **base_provenance(base_dir)}
    base_uri, tags = ensure_base_version(client, name, base_dir, model_config)
    info = log_completion_model(model_dir, {**model_config, "base_model_uri": base_uri}, ADAPTER_PIP_REQUIREMENTS)
    return info, {"model.kind": "lora-adapter", "base.model_uri": base_uri, **tags}
