"""One typed config, built from params.yaml plus overrides and validated before anything runs.

Config flows one way: params.yaml -> `load_config` -> `PipelineConfig` -> stage functions. Every failure is
a `ConfigError` whose message names the offending key. Each section's dataclasses sit beside the checks of
that section: `data` (task, data, prompt), `model` (the starting policy, the tiny default's shape), `sft`,
`grpo` (rewards, reference, DAPO options, LoRA), `evaluate` (held-out evaluation, the registry, metric
names), `operations` (tracking, serving, reports, distributed) and `monitors`; `pipeline` holds
`PipelineConfig`, `validate_config` (each section's checks, then the rules across sections) and
`config_warnings`; `loading` reads params and overrides into a config; `hashing` flattens and hashes
configs (`STAGE_PARAMS`, the fingerprint); `rules` holds `ConfigError` and `_require`. Import from
`components.config` itself: every public name is re-exported here.
"""

from components.config.data import DataConfig, PromptConfig, TaskConfig
from components.config.evaluate import FIXED_METRICS, PASS_AT_K, EvaluateConfig, RegisterConfig
from components.config.grpo import (
    DynamicSamplingConfig,
    EpisodeConfig,
    GRPOConfig,
    LoRAConfig,
    OverlongConfig,
    ReferenceConfig,
    RewardSpec,
)
from components.config.hashing import (
    NOT_IN_FINGERPRINT,
    STAGE_PARAMS,
    config_value,
    default_fingerprint,
    section_hash,
    stage_params_hash,
    to_flat_dict,
    trained_value,
)
from components.config.loading import apply_override, config_from_dict, load_config, read_params
from components.config.model import ModelConfig, TinyModelConfig
from components.config.monitors import MonitorsConfig, MonitorSpec, NoSignalConfig, NotLearningConfig
from components.config.operations import DistributedConfig, OperationsConfig, ReportsConfig, TrackingConfig
from components.config.pipeline import PipelineConfig, config_warnings, validate_config
from components.config.rules import ConfigError
from components.config.sft import SFTConfig

__all__ = [
    "FIXED_METRICS", "NOT_IN_FINGERPRINT", "PASS_AT_K", "STAGE_PARAMS",
    "ConfigError",
    "DataConfig", "DistributedConfig", "DynamicSamplingConfig", "EpisodeConfig", "EvaluateConfig", "GRPOConfig",
    "LoRAConfig",
    "ModelConfig", "MonitorSpec", "MonitorsConfig", "NoSignalConfig", "NotLearningConfig", "OperationsConfig",
    "OverlongConfig", "PipelineConfig", "PromptConfig", "ReferenceConfig", "RegisterConfig", "ReportsConfig",
    "RewardSpec", "SFTConfig", "TaskConfig", "TinyModelConfig", "TrackingConfig",
    "apply_override", "config_from_dict", "config_value", "config_warnings", "default_fingerprint",
    "load_config", "read_params", "section_hash", "stage_params_hash", "to_flat_dict", "trained_value",
    "validate_config",
]
