"""params.yaml (plus `key=value` overrides) -> a typed, validated `PipelineConfig`: each value checked
against its field's annotation, unknown keys refused with a suggestion."""

from __future__ import annotations

import dataclasses
import difflib
import re
import types
import typing
from pathlib import Path
from typing import Any, Literal

import yaml

from components.config.pipeline import PipelineConfig, validate_config
from components.config.rules import ConfigError

# PyYAML's safe loader on libyaml's parser where PyYAML was built with it (its wheels are): the same data as PyYAML's
# own parser, several times faster on params.yaml, which a run reads dozens of times.
SafeLoader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


def safe_load(text: str) -> Any:
    """`yaml.safe_load(text)` on `SafeLoader`."""
    return yaml.load(text, Loader=SafeLoader)  # a safe loader: builds plain data only


class ParamsLoader(SafeLoader):
    """PyYAML's safe loader reading numbers as YAML 1.2 does (DVC's parser): `1e-5` is a float, as `1.0e-5` is
    (YAML 1.1 wants the dot and the exponent's sign, and reads `1e-5` as a string)."""


ParamsLoader.yaml_implicit_resolvers = {k: list(v) for k, v in SafeLoader.yaml_implicit_resolvers.items()}
ParamsLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"), list("-+0123456789"))


def load_yaml(text: str) -> Any:
    """`text` as params.yaml is read everywhere in the pipeline (`ParamsLoader`)."""
    return yaml.load(text, Loader=ParamsLoader)  # a SafeLoader subclass: builds plain data only


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _coerce(value: Any, tp: Any, key: str) -> Any:
    """Check `value` against the annotation `tp`, converting YAML scalars where lossless."""
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(value, arg, key)
            except ConfigError as err:
                errors.append(str(err))
        raise ConfigError(errors[0] if errors else f"{key}: invalid value {value!r}")
    if origin is Literal:
        if value not in args:
            raise ConfigError(f"{key}: {value!r} is not one of {', '.join(map(repr, args))}")
        return value
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a mapping, got {type(value).__name__}")
        return dict(value)
    if origin is list:
        if not isinstance(value, list):
            raise ConfigError(f"{key}: expected a list, got {type(value).__name__}")
        return [_coerce(item, args[0], f"{key}[{i}]") for i, item in enumerate(value)]
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a mapping, got {type(value).__name__}")
        return _build(tp, value, key)
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{key}: expected true or false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{key}: expected an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, str):  # PyYAML (YAML 1.1) reads 1e-4 as a string; YAML 1.2 and users mean a number
            try:
                value = float(value)
            except ValueError:
                pass
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{key}: expected a number, got {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{key}: expected a string, got {value!r}")
        return value
    raise ConfigError(f"{key}: unsupported type {_type_name(tp)}")


def _build(cls: type, raw: dict[str, Any], prefix: str = "") -> Any:
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for key, value in raw.items():
        full = f"{prefix}.{key}" if prefix else str(key)
        if key not in hints:
            close = difflib.get_close_matches(str(key), names, n=1)
            hint = f" (did you mean '{prefix + '.' if prefix else ''}{close[0]}'?)" if close else ""
            raise ConfigError(f"{full}: unknown key{hint}")
        kwargs[key] = _coerce(value, hints[key], full)
    return cls(**kwargs)


def _parse_scalar(text: str) -> Any:
    """Parse a `--set` value the way YAML would (`"0.1"` -> `0.1`, `"true"` -> `True`, `"null"` -> `None`)."""
    return load_yaml(text) if text.strip() else ""


def apply_override(raw: dict[str, Any], assignment: str) -> None:
    """Apply one `key.sub=value` override to a raw params mapping in place."""
    if "=" not in assignment:
        raise ConfigError(f"{assignment}: overrides look like key.sub=value")
    dotted, text = assignment.split("=", 1)
    parts = dotted.strip().split(".")
    node = raw
    for part in parts[:-1]:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(f"{dotted}: '{part}' is not a section")
    node[parts[-1]] = _parse_scalar(text)


def read_params(path: str | Path) -> dict[str, Any]:
    """Read a params YAML file into a plain mapping (empty file -> {})."""
    path = Path(path)
    if not path.exists():
        raise ConfigError(f"{path}: params file does not exist")
    try:
        raw = load_yaml(path.read_text()) or {}
    except yaml.YAMLError as err:
        raise ConfigError(f"{path}: not valid YAML: {err}") from err
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: top level must be a mapping")
    return raw


def config_from_dict(raw: dict[str, Any]) -> PipelineConfig:
    """Build and validate a config from a raw mapping."""
    cfg = _build(PipelineConfig, raw)
    validate_config(cfg)
    return cfg


def load_config(path: str | Path = "params.yaml", overrides: list[str] | None = None) -> PipelineConfig:
    """params.yaml + `key=value` overrides -> a validated `PipelineConfig`."""
    raw = read_params(path)
    for assignment in overrides or []:
        apply_override(raw, assignment)
    return config_from_dict(raw)
