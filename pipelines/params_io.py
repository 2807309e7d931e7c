"""Write run-time overrides into params.yaml, keeping its comments (like `dvc exp run -S`).

DVC reproduces from params.yaml, so a run with `--set` or `--preset` records its effective
configuration there. The merged result is validated first: a bad override never touches the file.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

from components.config import apply_override, config_from_dict, read_params
from components.engine.rewards import check_rewards

PRESETS_DIR = Path(__file__).resolve().parent.parent / "configs" / "presets"


def _merge(base: dict[str, Any], overlay: dict[str, Any]) -> None:
    for key, value in overlay.items():
        if isinstance(value, dict) and isinstance(base.get(key), dict):
            _merge(base[key], value)
        else:
            base[key] = value


def preset_path(name: str) -> Path:
    path = PRESETS_DIR / f"{name}.yaml"
    if not path.exists():
        available = sorted(p.stem for p in PRESETS_DIR.glob("*.yaml"))
        raise ValueError(f"--preset {name}: unknown preset; available: {', '.join(available)}")
    return path


def merged_config(params_path: Path, overlays: list[Path], overrides: list[str]):
    """params.yaml + overlay files + `key=value` overrides, validated, without writing anything."""
    merged = read_params(params_path)
    for overlay in overlays:
        _merge(merged, read_params(overlay))
    for assignment in overrides:
        apply_override(merged, assignment)
    cfg = config_from_dict(merged)  # raises ConfigError naming the key
    check_rewards(cfg.grpo.rewards)
    return cfg


def apply_to_params(params_path: Path, overlays: list[Path], overrides: list[str]) -> bool:
    """Overlay files then `key=value` overrides onto params.yaml; returns whether it changed."""
    from ruamel.yaml import YAML

    merged_config(params_path, overlays, overrides)  # a bad override never touches the file
    if not overlays and not overrides:
        return False  # nothing to apply: the file stays byte for byte

    yaml = YAML()
    yaml.preserve_quotes = True
    yaml.indent(mapping=2, sequence=4, offset=2)  # params.yaml's own list style
    # `null` stays `null` (ruamel would write an empty value: a diff on every key that was null)
    yaml.representer.add_representer(type(None), lambda rep, _: rep.represent_scalar("tag:yaml.org,2002:null", "null"))
    doc = yaml.load(params_path.read_text())
    for overlay in overlays:
        _merge_roundtrip(doc, yaml.load(overlay.read_text()) or {})
    for assignment in overrides:
        apply_override(doc, assignment)
    buffer = io.StringIO()
    yaml.dump(doc, buffer)
    changed = buffer.getvalue() != params_path.read_text()
    if changed:
        tmp = params_path.with_suffix(".yaml.tmp")
        tmp.write_text(buffer.getvalue())
        tmp.replace(params_path)
    return changed


def _merge_roundtrip(doc: Any, overlay: dict[str, Any]) -> None:
    for key, value in overlay.items():
        if isinstance(value, dict) and isinstance(doc.get(key), dict):
            _merge_roundtrip(doc[key], value)
        else:
            doc[key] = value
