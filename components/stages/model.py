"""Stage `model`: the starting policy and its tokenizer.

For the embedded default, builds a tiny Llama and a character-level tokenizer from the characters
of the prepared datasets and saves them with `save_pretrained`. For a user's model directory it only checks the
directory loads safely and records a pointer (no multi-GB copy). A GGUF file is converted once to a float
safetensors folder (components/engine/models/gguf_model.py),
with the GGUF's sha256 in `provenance.json` and the MLflow tags.
"""

from __future__ import annotations

import sys

from components.config import PipelineConfig
from components.data.model_source import gguf_source
from components.data.paths import Paths
from components.data.records import SPLITS, iter_jsonl, split_path
from components.engine.models.gguf_model import convert_gguf, file_sha256
from components.engine.models.modeling import (
    build_char_tokenizer,
    build_tiny_model,
    count_parameters,
    hub_download_allowed,
    resolve_model_dir,
    save_model,
    write_pointer,
    write_provenance,
)
from components.stages.cli import stage_main


def dataset_texts(paths: Paths):
    """Every prompt and answer string of the prepared splits (the tokenizer's alphabet)."""
    for split in SPLITS:
        for _, record in iter_jsonl(split_path(paths.data, split)):
            for key in ("prompt", "answer"):
                if isinstance(record.get(key), str):
                    yield record[key]


def build_base_model(cfg: PipelineConfig, paths: Paths = Paths()) -> None:
    from components.tracking.runs import stage_run

    out = paths.base_model
    with stage_run(cfg.tracking.experiment, "model") as run:
        gguf = gguf_source(cfg.model.name_or_path, cfg.model.gguf_file)
        if gguf is not None:
            sha256 = file_sha256(gguf)
            print(f"model: converting {gguf.name} (sha256 {sha256[:12]}) to safetensors ...", flush=True)
            parameters = convert_gguf(gguf, out)
            source = {"source": cfg.model.name_or_path, "gguf_file": str(gguf), "gguf_sha256": sha256,
                      "parameters": parameters}
            write_provenance(out, source)
            run.set_tags({"model.source": cfg.model.name_or_path, "model.gguf_sha256": sha256})
            run.log_metrics({"parameters": parameters})
            print(f"model: {parameters:,} parameters from {gguf.name}, float32 safetensors in {out}")
            return
        if cfg.model.name_or_path:
            hub = hub_download_allowed(cfg.model.name_or_path, cfg.model.allow_download)
            if not hub:
                resolve_model_dir(cfg.model.name_or_path)
            write_pointer(out, cfg.model.name_or_path, hub=hub)
            run.set_tags({"model.source": cfg.model.name_or_path})
            print(f"model: using {cfg.model.name_or_path}")
            return
        tokenizer = build_char_tokenizer(dataset_texts(paths))
        model = build_tiny_model(cfg.model.tiny, tokenizer, cfg.seed)
        parameters = count_parameters(model)
        save_model(model, tokenizer, out, extra={"source": "tiny", "parameters": parameters})
        run.set_tags({"model.source": "tiny"})
        run.log_metrics({"parameters": parameters, "vocabulary": len(tokenizer)})
        print(f"model: tiny Llama, {parameters:,} parameters, vocabulary {len(tokenizer)}")


def main(argv: list[str] | None = None) -> int:
    return stage_main("Build or locate the starting model.", build_base_model, argv)


if __name__ == "__main__":
    sys.exit(main())
