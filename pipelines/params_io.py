"""A run's overrides in params.yaml, for that run only unless it says `--persist`.

DVC reproduces from params.yaml, so a run with `--set`, `--preset` or `--params` writes its effective
configuration there (keeping the file's comments), and `dvc repro` reproduces that run. Unless the run
says `--persist`, the user's own params.yaml is kept beside it (`.params.base.yaml`), and the next run
without overrides puts it back: an example does not change what a plain `make run` means. If the user
edited params.yaml in between (also after a run that was killed with its overrides in place), the next run
puts the user's own settings back with those edits, and says which it kept. The merged result is validated
first: a bad override never touches the file.
"""

from __future__ import annotations

import hashlib
import io
import json
import tempfile
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


def _roundtrip(text: str):
    """(a ruamel YAML in params.yaml's own style, `text` loaded with its comments)."""
    from ruamel.yaml import YAML

    yaml = YAML()
    yaml.preserve_quotes = True
    yaml.indent(mapping=2, sequence=4, offset=2)  # params.yaml's own list style
    # `null` stays `null` (ruamel would write an empty value: a diff on every key that was null)
    yaml.representer.add_representer(type(None), lambda rep, _: rep.represent_scalar("tag:yaml.org,2002:null", "null"))
    return yaml, yaml.load(text)


def apply_to_params(params_path: Path, overlays: list[Path], overrides: list[str]) -> bool:
    """Overlay files then `key=value` overrides onto params.yaml; returns whether it changed."""
    merged_config(params_path, overlays, overrides)  # a bad override never touches the file
    if not overlays and not overrides:
        return False  # nothing to apply: the file stays byte for byte

    yaml, doc = _roundtrip(params_path.read_text())
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


def _note(root: Path) -> dict[str, Any]:
    try:
        return json.loads((root / RUN_NOTE).read_text())
    except (OSError, ValueError):
        return {}


def _own_settings(root: Path) -> tuple[str | None, str]:
    """(the user's own params.yaml text when the previous run's one-off overrides still occupy params.yaml, else
    None; what to say about it). The user's own is `.params.base.yaml`, plus every key the user edited in
    params.yaml since those overrides were applied (the run's note keeps params.yaml as applied)."""
    base, params, note = root / BASE_FILE, root / "params.yaml", _note(root)
    if not base.exists() or not note:
        return None, ""
    run = f"the previous run's one-off overrides ({note.get('overrides') or 'its --set/--preset/--params'})"
    if not note.get("finished", True):
        run += ", whose run was stopped before it could put your settings back,"
    if note.get("sha256") == _sha256(params):
        return base.read_text(), f"params.yaml: back to your own settings ({run} were for that run only; " \
                                 "--persist keeps them)"
    if "applied" not in note:  # a note written before edits were told apart: the file as the user left it
        return None, "params.yaml: edited since the previous run's overrides were applied; kept as it is"
    applied, edited = _flat(yaml_load(note["applied"])), _flat(yaml_load(params.read_text()))
    mine = {key: value for key, value in edited.items() if applied.get(key, _MISSING) != value}
    own = _with_values(base.read_text(), mine)
    kept = ", ".join(f"{key}: {json.dumps(value)}" for key, value in mine.items())
    return own, f"params.yaml: back to your own settings ({run} were still in it), keeping your edit since: {kept}"


_MISSING = object()


def yaml_load(text: str) -> dict[str, Any]:
    import yaml

    return yaml.safe_load(text) or {}


def _flat(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """`{"grpo.learning_rate": 0.001, ...}`: every leaf by its dotted key (lists are leaves)."""
    out: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict) and value:
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def _with_values(text: str, values: dict[str, Any]) -> str:
    """`text` (a params file) with each dotted key set to its value, comments and layout kept."""
    yaml, doc = _roundtrip(text)
    for dotted, value in values.items():
        node, parts = doc, dotted.split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
        node[parts[-1]] = value
    buffer = io.StringIO()
    yaml.dump(doc, buffer)
    return buffer.getvalue()


def user_params(root: Path) -> Path:
    """The user's own configuration as a file: params.yaml, or while the last run's one-off overrides occupy it,
    `.params.base.yaml` (plus the user's edits since, in a scratch copy)."""
    own, _ = _own_settings(root)
    if own is None:
        return root / "params.yaml"
    if own == (root / BASE_FILE).read_text():
        return root / BASE_FILE
    scratch = Path(tempfile.mkdtemp(prefix="grpo-own-params-")) / "params.yaml"
    scratch.write_text(own)
    return scratch


def mark_finished(root: Path) -> None:
    """The run whose one-off overrides occupy params.yaml ended as it should (not killed)."""
    note = _note(root)
    if note:
        (root / RUN_NOTE).write_text(json.dumps({**note, "finished": True}))


def prepare_params(root: Path, overlays: list[Path], overrides: list[str], persist: bool,
                   described: str = "") -> list[str]:
    """Make params.yaml this run's configuration: the user's own (first put back when an earlier run's one-off
    overrides still occupy it, the user's edits since kept) plus this run's overrides. Returns what to print.
    Without `persist` the user's own is kept in `.params.base.yaml` for the next plain run."""
    params, base, note = root / "params.yaml", root / BASE_FILE, root / RUN_NOTE
    said = []
    if base.exists():
        own, text = _own_settings(root)
        if own is not None:
            params.write_text(own)
        if text and (own is None or own != base.read_text() or not overlays and not overrides):
            said.append(text)
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
    note.write_text(json.dumps({"sha256": _sha256(params), "overrides": described, "applied": params.read_text(),
                                "finished": False}))
    said.append("params.yaml holds this run's settings, so `dvc repro` reproduces it; the next run without "
                f"overrides goes back to your own (kept as {BASE_FILE}); add --persist to keep them")
    return said


def _merge_roundtrip(doc: Any, overlay: dict[str, Any]) -> None:
    for key, value in overlay.items():
        if isinstance(value, dict) and isinstance(doc.get(key), dict):
            _merge_roundtrip(doc[key], value)
        else:
            doc[key] = value
