"""Configs as MLflow params and as hashes: the flat `a.b.c` view, the params each DVC stage depends on
(`STAGE_PARAMS`), the hashes resumable state and lineage are keyed by, and the default's fingerprint."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from typing import TYPE_CHECKING, Any

from components.losses import LOSSES, SETTINGS_RECORDS
from components.records import settings_keys
from components.rollout_engines import neutral_engine_keys

if TYPE_CHECKING:
    from components.config.pipeline import PipelineConfig


def to_flat_dict(cfg: Any, prefix: str = "") -> dict[str, Any]:
    """Flatten a config into `a.b.c -> value` for MLflow params (mappings too, so every leaf has its own
    key and secret-looking keys such as `...options.api_token` can be recognised and dropped)."""
    out: dict[str, Any] = {}
    items = ((f.name, getattr(cfg, f.name)) for f in dataclasses.fields(cfg)) if dataclasses.is_dataclass(cfg) \
        else cfg.items()
    for name, value in items:
        key = f"{prefix}{name}"
        if dataclasses.is_dataclass(value) or (isinstance(value, dict) and value):
            out.update(to_flat_dict(value, key + "."))
        elif isinstance(value, list) and value and all(dataclasses.is_dataclass(v) or isinstance(v, dict)
                                                       for v in value):
            for i, item in enumerate(value):
                out.update(to_flat_dict(item, f"{key}.{i}."))
        else:
            out[key] = value
    return out


# The params each DVC stage lists in dvc.yaml (tests/test_dvc_deps.py keeps the two equal). What a stage
# keys its resumable state to is derived from the same list, so DVC re-running a stage and the stage
# refusing to resume from other inputs can never disagree.
STAGE_PARAMS: dict[str, tuple[str, ...]] = {
    "prepare": ("seed", "task", "data"),
    "model": ("seed", "model"),
    "validate": ("prompt", "model.trust_remote_code", "grpo.max_completion_length", "evaluate.max_new_tokens"),
    "sft": ("seed", "threads", "device", "prompt", "model.dtype", "model.trust_remote_code", "sft", "grpo.rewards",
            "grpo.max_completion_length", "distributed.nproc"),
    "grpo": ("seed", "threads", "device", "prompt", "model.dtype", "model.trust_remote_code", "grpo", "distributed",
             "evaluate.every", "evaluate.during_training_n", "evaluate.metrics", "evaluate.max_new_tokens", "monitors"),
    "evaluate": ("seed", "threads", "device", "prompt", "model.dtype", "model.trust_remote_code", "evaluate",
                 "grpo.rewards"),
    "register": ("seed", "prompt", "evaluate.bootstrap_samples", "evaluate.max_new_tokens", "register", "tracking"),
}


def config_value(cfg: Any, dotted: str) -> Any:
    """The config value at a dotted params key (`grpo.lora.rank`)."""
    value = cfg
    for part in dotted.split("."):
        value = getattr(value, part)
    return value


def trained_value(cfg: Any, key: str) -> Any:
    """A params value as it bears on what is trained. `distributed` reduces to whether sampling is seeded
    per group: the process count, backend and sharding change where it runs, not the result (N
    processes give one process's weights, tests/engine/parallel/test_distributed.py), so a run may resume on other
    hardware."""
    if key == "distributed":
        d = cfg.distributed
        return {"per_group_sampling": d.per_group_sampling or d.nproc > 1}
    return config_value(cfg, key)


def stage_params_hash(cfg: PipelineConfig, stage: str, *inputs: Any) -> str:
    """`section_hash` of the params DVC lists for `stage` (as they bear on the result), plus input hashes."""
    return section_hash({key: trained_value(cfg, key) for key in STAGE_PARAMS[stage]}, *inputs)


# Keys that change what a run reports or watches, not the held-out reward before and after it.
NOT_IN_FINGERPRINT = {"seed", "monitors", "evaluate.every", "evaluate.during_training_n", "evaluate.metrics",
                      "evaluate.pass_k_temperature", "evaluate.pass_k_top_p", "evaluate.pass_k_top_k",
                      "evaluate.pass_k_samples", "evaluate.correct_at", "grpo.log_every", "grpo.metrics_every"}

# Options added after the band was measured that change nothing at their default: left out while at it, so that a
# new option does not retire the band (one away from its default is in the fingerprint like any other key).
NEUTRAL_AT_DEFAULT = ("grpo.multi_objective_aggregation", "grpo.top_entropy_quantile", "grpo.rollout_correction",
                      "grpo.rollout_correction_max", "grpo.rollout_correction_min",
                      "grpo.lora.quantize_base", "grpo.tools", "grpo.environment", "grpo.episode",
                      *(f"grpo.{key}" for key in neutral_engine_keys()))  # engines the band was not measured with


def default_fingerprint(cfg: PipelineConfig) -> str:
    """Hash of the params that bear on the held-out reward before and after GRPO (not the seed, the monitors
    or what is reported): a run with the fingerprint benchmarks/seed_spread.py recorded may compare itself
    with the band it measured (tests/test_config.py keeps the default's equal to the recorded one)."""
    keys = {key for stage in ("prepare", "model", "sft", "grpo", "evaluate") for key in STAGE_PARAMS[stage]}
    values = {key: dataclasses.asdict(v) if dataclasses.is_dataclass(v := config_value(cfg, key)) else v
              for key in sorted(keys - NOT_IN_FINGERPRINT)}
    for dotted in NOT_IN_FINGERPRINT:
        section, _, field_name = dotted.partition(".")
        if isinstance(values.get(section), dict):
            values[section].pop(field_name, None)
    for key in unused_loss_settings(cfg.grpo.loss_type):  # the settings of a loss the run does not use change nothing
        values["grpo"].pop(key, None)
    defaults = type(cfg)()
    for dotted in NEUTRAL_AT_DEFAULT:
        *path, field_name = dotted.split(".")
        holder, default = values, defaults
        for part in path:
            holder, default = holder[part], getattr(default, part)
        default = getattr(default, field_name)
        if holder.get(field_name) == (dataclasses.asdict(default) if dataclasses.is_dataclass(default) else default):
            holder.pop(field_name)
    return section_hash(values)


def unused_loss_settings(loss_type: str) -> list[str]:
    """The `grpo.*` keys of the other losses' settings records (components/losses.py), which `loss_type` never
    reads."""
    used = LOSSES[loss_type].settings
    return [key for record in SETTINGS_RECORDS if record is not used for key in settings_keys(record)]


def section_hash(*sections: Any) -> str:
    """Stable short hash of config sections: keys resume state and lineage tags to their inputs."""
    def plain(value: Any) -> Any:
        if dataclasses.is_dataclass(value):
            return dataclasses.asdict(value)
        if isinstance(value, dict):
            return {k: plain(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [plain(v) for v in value]
        return value

    payload = json.dumps([plain(s) for s in sections], sort_keys=True, default=str)
    return hashlib.sha256(payload.encode()).hexdigest()[:16]
