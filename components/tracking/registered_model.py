"""What the registry stores for a trained model: the full model, or a LoRA adapter linked to its base.

A LoRA adapter is a few MB; its base (hundreds of MB) is registered once, as `<model_name>-base`,
keyed by the base directory's hash, and every adapter version names it (`base_model_uri`) and carries
its source and hashes as tags. Loading `models:/NAME@champion` in a fresh process loads the base version
and applies the adapter (components/tracking/serving_model.py). `register.merge_lora: true` registers the merged
model instead, as self-contained as a full fine-tune.

Every logged model ships the package `grpo_served` beside its code (MLflow's `code_paths`): copies of the modules that
lay out conversations (engine/generation/environments/chat.py), read tool calls
(engine/generation/environments/calls.py) and speak OpenAI's chat format (tracking/chat_request.py), each standard
library only, so the served model answers chat requests as training laid out and parsed its episodes, without this
repository.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from components.config import PipelineConfig
from components.data.records import dir_md5
from components.engine.generation.environments import calls, chat
from components.engine.models import prompt_text
from components.engine.models.modeling import adapter_base, resolve_model_dir
from components.tracking import chat_request

SERVING_MODULE = Path(__file__).with_name("serving_model.py")
SERVED_PACKAGE = "grpo_served"
SERVED_MODULES = {"chat.py": Path(chat.__file__), "calls.py": Path(calls.__file__),
                  "chat_request.py": Path(chat_request.__file__), "prompt_text.py": Path(prompt_text.__file__)}
PIP_REQUIREMENTS = ["torch", "transformers", "safetensors", "pandas"]
ADAPTER_PIP_REQUIREMENTS = PIP_REQUIREMENTS + ["peft"]


def _signature():
    """A prompt per row (`prompt`), or one chat conversation (`messages`, `tools`, `max_tokens`)."""
    from mlflow.models import ModelSignature
    from mlflow.types import ColSpec, Schema
    from mlflow.types.schema import AnyType, Array

    inputs = Schema([ColSpec("string", "prompt", required=False),
                     ColSpec(Array(AnyType()), "messages", required=False),
                     ColSpec(Array(AnyType()), "tools", required=False),
                     ColSpec("long", "max_tokens", required=False)])
    return ModelSignature(inputs=inputs, outputs=Schema([ColSpec("string")]))


def serving_config(cfg: PipelineConfig, tokenizer: Any) -> dict[str, Any]:
    """What the served model needs to answer as training did: the prompt formatting, the answer length, the
    registered name, and the schemas of the tools it was trained with (offered when a chat request lists none)."""
    from components.engine.models.prompting import PromptFormatter

    serving = {"max_new_tokens": cfg.evaluate.max_new_tokens, **PromptFormatter(cfg.prompt, tokenizer).settings(),
               "model_name": cfg.register.model_name}
    if cfg.grpo.tools:
        from components.engine.generation.environments.tools import load_tools

        # JSON text: the MLmodel file's YAML would sort the schemas' keys, and the model reads them in their order
        serving["tools"] = json.dumps([t.schema for t in load_tools(cfg.grpo.tools)], ensure_ascii=False)
    return serving


@contextmanager
def served_package() -> Iterator[Path]:
    """A temporary `grpo_served` package: byte-for-byte copies of SERVED_MODULES."""
    tmp = Path(tempfile.mkdtemp(prefix="grpo-served-"))
    package = tmp / SERVED_PACKAGE
    try:
        package.mkdir()
        (package / "__init__.py").write_text('"""The pipeline\'s chat layout, call parser and chat request format, '
                                             'shipped with the registered model."""\n')
        for name, source in SERVED_MODULES.items():
            shutil.copyfile(source, package / name)
        yield package
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


# MLflow's advice at logging that does not apply here: the model takes two input shapes (prompts or one conversation),
# so its `predict` has no single type hint, and its signature is given explicitly (`_signature`), not inferred.
MLFLOW_ADVICE = ("Add type hints to the `predict` method", "An input example was not provided")


def log_completion_model(model_dir: Path, model_config: dict[str, Any], requirements: list[str]):
    """Log `model_dir` as the pyfunc completion model in the active run; returns MLflow's ModelInfo."""
    import warnings

    import mlflow

    with served_package() as package, warnings.catch_warnings():
        # Not a filter: MLflow sets its own ("once") around the code that warns, which a filter set here loses to.
        shown = warnings.showwarning

        def show(message, category, filename, lineno, file=None, line=None) -> None:
            if not any(advice in str(message) for advice in MLFLOW_ADVICE):  # any other warning still shows
                shown(message, category, filename, lineno, file, line)

        warnings.showwarning = show
        return mlflow.pyfunc.log_model(name="model", python_model=str(SERVING_MODULE),
                                       artifacts={"model_dir": str(model_dir)}, pip_requirements=requirements,
                                       model_config=model_config, signature=_signature(), code_paths=[str(package)])


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
