"""A run's overrides in params.yaml, for that run only unless it says `--persist`.

DVC reproduces from params.yaml, so a run with `--set`, `--preset` or `--params` writes its effective
configuration there (keeping the file's comments), and `dvc repro` reproduces that run. Unless the run
says `--persist`, the user's own params.yaml is kept beside it (`.params.base.yaml`), and the next run
without overrides puts it back: an example does not change what a plain `make run` means. If the user
edited params.yaml in between, the edit wins. The merged result is validated first: a bad override never
touches the file.
"""

from __future__ import annotations

import hashlib
import io
import json
import shutil
from pathlib import Path
from typing import Any

from components.config import apply_override, config_from_dict, read_params
from components.engine.rewards.rewards import check_rewards

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
    if cfg.grpo.tools or cfg.grpo.environment:  # imports the user's tools or environment (and torch): only then
        from components.engine.environments.spec import check_episodes

        check_episodes(cfg.grpo)
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


BASE_FILE = ".params.base.yaml"
"""The user's params.yaml while a run's overrides occupy it."""
RUN_NOTE = ".params.run.json"
"""{"sha256": params.yaml as the override run left it, "overrides": what they were}."""


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def user_params(root: Path) -> Path:
    """The user's own configuration: `.params.base.yaml` while the last run's overrides occupy params.yaml
    unchanged, params.yaml otherwise."""
    base, note, params = root / BASE_FILE, root / RUN_NOTE, root / "params.yaml"
    if base.exists() and note.exists() and json.loads(note.read_text()).get("sha256") == _sha256(params):
        return base
    return params


def prepare_params(root: Path, overlays: list[Path], overrides: list[str], persist: bool,
                   described: str = "") -> list[str]:
    """Make params.yaml this run's configuration: the user's own plus this run's overrides. Returns what to
    print. Without `persist` the user's own is kept in `.params.base.yaml` for the next plain run."""
    params, base, note = root / "params.yaml", root / BASE_FILE, root / RUN_NOTE
    said = []
    if base.exists():
        if user_params(root) == base:
            shutil.copy2(base, params)
            if not overlays and not overrides:
                said.append("params.yaml: back to your own settings (the previous run's overrides were for that run "
                            "only; --persist keeps them)")
        elif not overlays and not overrides:
            said.append("params.yaml: edited since the previous run's overrides were applied; kept as it is")
        base.unlink()
        note.unlink(missing_ok=True)
    if not overlays and not overrides:
        return said
    before = params.read_bytes()
    if not apply_to_params(params, overlays, overrides):
        return said
    if persist:
        said.append(f"params.yaml updated with the run's settings for good (--persist; git diff {params.name} "
                    "shows them)")
        return said
    base.write_bytes(before)
    note.write_text(json.dumps({"sha256": _sha256(params), "overrides": described}))
    said.append("params.yaml holds this run's settings, so `dvc repro` reproduces it; the next run without "
                f"overrides goes back to your own (kept as {BASE_FILE}); add --persist to keep them")
    return said


def _merge_roundtrip(doc: Any, overlay: dict[str, Any]) -> None:
    for key, value in overlay.items():
        if isinstance(value, dict) and isinstance(doc.get(key), dict):
            _merge_roundtrip(doc[key], value)
        else:
            doc[key] = value
