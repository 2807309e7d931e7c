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

import functools
import hashlib
import io
import json
import re
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from components.config import ConfigError, apply_override, config_from_dict, read_params
from components.config.loading import load_yaml
from components.data.records import write_text_atomic
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
        from components.engine.generation.environments.spec import check_episodes

        check_episodes(cfg.grpo)
    return cfg


@functools.cache
def _params_representer() -> type:
    """ruamel's round-trip representer writing `null` as `null` (not an empty value: a diff on every key that was
    null) and floats as `float_text`; a subclass, so that DVC's round trip in the same process writes as it did."""
    from ruamel.yaml.representer import RoundTripRepresenter

    class ParamsRepresenter(RoundTripRepresenter):
        pass

    ParamsRepresenter.add_representer(type(None),
                                      lambda rep, _: rep.represent_scalar("tag:yaml.org,2002:null", "null"))
    ParamsRepresenter.add_representer(float, lambda rep, value: rep.represent_scalar("tag:yaml.org,2002:float",
                                                                                      float_text(value)))
    return ParamsRepresenter


def _roundtrip(text: str):
    """(a ruamel YAML in params.yaml's own style, `text` loaded with its comments)."""
    from ruamel.yaml import YAML

    yaml = YAML()
    yaml.Representer = _params_representer()
    yaml.preserve_quotes = True
    yaml.indent(mapping=2, sequence=4, offset=2)  # params.yaml's own list style
    return yaml, yaml.load(text)


def float_text(value: float) -> str:
    """A float as text every YAML reader takes for that float: Python's shortest repr, with the dot and exponent sign
    YAML 1.1 readers need (`5e-05` -> `5.0e-05`, `1e+20` -> `1.0e+20`); `.inf`, `-.inf`, `.nan` as YAML spells them."""
    if value != value:
        return ".nan"
    if value in (float("inf"), float("-inf")):
        return ".inf" if value > 0 else "-.inf"
    mantissa, e, exponent = repr(value).partition("e")
    if e and "." not in mantissa:
        mantissa += ".0"
    return mantissa + (f"e{'' if exponent[0] in '+-' else '+'}{exponent}" if e else "")


def render_params(params_path: Path, overlays: list[Path], overrides: list[str]) -> str | None:
    """params.yaml's text with overlay files then `key=value` overrides applied, in the file's own style (None when
    nothing changes). Validated first (a bad override never touches the file), and read back by DVC's own YAML 1.2
    parser exactly as the pipeline reads it: values that need quotes there get them (`[calculator, "pkg.mod:fn"]`)."""
    merged_config(params_path, overlays, overrides)
    if not overlays and not overrides:
        return None  # nothing to apply: the file stays byte for byte
    yaml, doc = _roundtrip(params_path.read_text())
    for overlay in overlays:
        _merge_roundtrip(doc, yaml.load(overlay.read_text()) or {})
    for assignment in overrides:
        apply_override(doc, assignment)
    text = _dump(yaml, doc)
    problem = dvc_reading_problem(text, before=params_path.read_text())
    if problem:
        raise ConfigError(f"{params_path.name} as this run would write it: {problem}")
    return None if text == params_path.read_text() else text


def apply_to_params(params_path: Path, overlays: list[Path], overrides: list[str]) -> bool:
    """Overlay files then `key=value` overrides onto params.yaml (in one rename); returns whether it changed."""
    text = render_params(params_path, overlays, overrides)
    if text is None:
        return False
    write_text_atomic(params_path, text)
    return True


def _plain_in_flow(text: str) -> bool:
    """DVC's parser reads `text` written plain inside `[...]` as that very string."""
    from dvc.utils.serialize import parse_yaml

    try:
        return parse_yaml(f"[{text}]", "params.yaml") == [text]
    except Exception:  # noqa: BLE001 - it cannot read it at all
        return False


def _quoted_for_dvc(node: Any, in_flow: bool = False) -> Any:
    """`node` with every string inside a `[...]` or `{...}` that DVC cannot read plain double-quoted: DVC's YAML 1.2
    parser (ruamel) refuses `[calculator, pkg.mod:fn]` (`found unexpected ':'`), which ruamel's own writer and PyYAML
    accept; in block lists and mappings it reads them plain."""
    from ruamel.yaml.comments import CommentedMap, CommentedSeq
    from ruamel.yaml.scalarstring import DoubleQuotedScalarString, ScalarString

    if isinstance(node, CommentedMap | dict):
        flow = in_flow or (isinstance(node, CommentedMap) and node.fa.flow_style())
        for key in list(node):
            node[key] = _quoted_for_dvc(node[key], flow)
    elif isinstance(node, CommentedSeq | list):
        flow = in_flow or (isinstance(node, CommentedSeq) and node.fa.flow_style())
        for i, item in enumerate(node):
            node[i] = _quoted_for_dvc(item, flow)
    elif isinstance(node, str) and in_flow and not isinstance(node, ScalarString) \
            and not _plain_in_flow(node):
        return DoubleQuotedScalarString(node)
    return node


def _dump(yaml: Any, doc: Any) -> str:
    buffer = io.StringIO()
    yaml.dump(_quoted_for_dvc(doc), buffer)
    return buffer.getvalue()


def _dvc_differences(text: str) -> dict[str, tuple[Any, Any]] | str:
    """{key: (as DVC reads it, as the pipeline reads it)} for every leaf DVC's parser (YAML 1.2) reads otherwise than
    the pipeline's (PyYAML), or why DVC cannot read `text` at all, in words a user can act on."""
    from dvc.utils.serialize import parse_yaml

    try:
        theirs = parse_yaml(text, "params.yaml")
    except Exception as err:  # noqa: BLE001 - DVC's YAMLFileCorruptedError; its cause says where
        cause = str(err.__cause__ or err).replace("\n", " ")
        where = re.findall(r"line (\d+), column \d+", cause)
        line = text.splitlines()[int(where[-1]) - 1].strip() if where else ""
        found = re.search(r"found (.*?)\s+in \"", cause)
        return (f"DVC reads params.yaml as YAML 1.2 and cannot read {f'line {where[-1]} ({line!r})' if where else 'it'}"
                f"{f' (found {found.group(1)})' if found else ''}: quote a value with a ':' inside [...] "
                '(`[calculator, "pkg.mod:fn"]`) or write the list one item a line (`- pkg.mod:fn`)')
    flat_ours, flat_theirs = _flat(yaml_load(text)), _flat(theirs or {})
    return {key: (flat_theirs.get(key), flat_ours.get(key)) for key in sorted(set(flat_ours) | set(flat_theirs))
            if flat_ours.get(key, _MISSING) != flat_theirs.get(key, _MISSING)}


def dvc_reading_problem(text: str, before: str | None = None) -> str | None:
    """None when DVC reads `text` exactly as the pipeline does, leaving aside values read differently already in
    `before` (the file as the user wrote it: a `yes` DVC reads as a word is theirs to keep); else what differs."""
    found = _dvc_differences(text)
    if isinstance(found, str):
        return found
    kept = _dvc_differences(before) if before is not None else {}
    for key, (theirs, ours) in found.items():
        if isinstance(kept, str) or key not in kept:
            return (f"DVC (YAML 1.2) reads {key} as {theirs!r}, the pipeline as {ours!r}: quote the value, or write "
                    "it as the number or word you mean")
    return None


def check_dvc_reads(params_path: Path) -> None:
    """Refuse, in one line naming the line and the fix, a params file DVC cannot read (values it reads otherwise than
    the pipeline, as the user wrote them, are theirs: DVC only hashes them)."""
    text = params_path.read_text()
    problem = dvc_reading_problem(text, before=text)
    if problem:
        raise ConfigError(f"{params_path.name}: {problem}")


BASE_FILE = ".params.base.yaml"
"""The user's params.yaml while a run's overrides occupy it."""
RUN_NOTE = ".params.run.json"
"""{"sha256": params.yaml as the override run writes it, "overrides": what they were, "applied": that text,
"finished": whether its run ended as it should}. Written before params.yaml is, each file in one rename."""
KILLED_COPY = Path("logs") / "params-left-by-a-killed-run.yaml"
"""params.yaml as a killed run left it, kept when what it changed cannot be told from the user's edits."""


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _note(root: Path) -> dict[str, Any] | None:
    """The override run's note; {} when there is none, None when it cannot be read (cut short by a kill)."""
    path = root / RUN_NOTE
    if not path.exists():
        return {}
    try:
        note = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return note if isinstance(note, dict) and "sha256" in note else None


def _readable(text: str) -> bool:
    try:
        return isinstance(yaml_load(text), dict)
    except Exception:  # noqa: BLE001 - any YAML error: not a params file
        return False


def _own_settings(root: Path) -> tuple[str | None, str]:
    """(the user's own params.yaml text when the previous run's one-off overrides still occupy params.yaml, else
    None; what to say about it). The user's own is `.params.base.yaml`, plus every key the user edited in
    params.yaml since those overrides were applied (the run's note keeps params.yaml as applied). A note or a
    params.yaml a kill cut short: the user's own is `.params.base.yaml` as it is, and params.yaml as that run left it
    is kept in logs/ (edits made in it since cannot be told from the overrides)."""
    base, params, note = root / BASE_FILE, root / "params.yaml", _note(root)
    if not base.exists() or not _readable(base.read_text()):
        return None, ""
    if params.exists() and params.read_bytes() == base.read_bytes():
        return None, ""  # already the user's own (put back, or the run was killed before writing its overrides)
    run = f"the previous run's one-off overrides ({(note or {}).get('overrides') or 'its --set/--preset/--params'})"
    if not (note or {}).get("finished", True):
        run += ", whose run was stopped before it could put your settings back,"
    current = params.read_text(errors="replace") if params.exists() else ""
    if note is None or not _readable(current):  # restore_own_settings keeps params.yaml's text in logs/ first
        damaged = ".params.run.json" if note is None else "params.yaml"
        return base.read_text(), (f"params.yaml: back to your own settings (a kill cut the previous run's {damaged} "
                                  "short, so its one-off overrides could not be told from your edits; params.yaml as "
                                  f"it left it is {KILLED_COPY})")
    if note and note.get("sha256") == _sha256(params.read_bytes()):
        return base.read_text(), f"params.yaml: back to your own settings ({run} were for that run only; " \
                                 "--persist keeps them)"
    if "applied" not in note:  # a note written before edits were told apart: the file as the user left it
        return None, "params.yaml: edited since the previous run's overrides were applied; kept as it is"
    applied, edited = _flat(yaml_load(note["applied"])), _flat(yaml_load(current))
    mine = {key: value for key, value in edited.items() if applied.get(key, _MISSING) != value}
    own = _with_values(base.read_text(), mine)
    kept = ", ".join(f"{key}: {json.dumps(value)}" for key, value in mine.items())
    return own, f"params.yaml: back to your own settings ({run} were still in it), keeping your edit since: {kept}"


_MISSING = object()


def yaml_load(text: str) -> dict[str, Any]:
    return load_yaml(text) or {}


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
    return _dump(yaml, doc)


@contextmanager
def user_params(root: Path) -> Iterator[Path]:
    """The user's own configuration as a file, for the block: params.yaml, or while the last run's one-off overrides
    occupy it, `.params.base.yaml` (plus the user's edits since: a scratch copy, removed when the block ends)."""
    own, _ = _own_settings(root)
    if own is None:
        yield root / "params.yaml"
    elif own == (root / BASE_FILE).read_text():
        yield root / BASE_FILE
    else:
        with tempfile.TemporaryDirectory(prefix="grpo-own-params-") as scratch:
            path = Path(scratch) / "params.yaml"
            path.write_text(own)
            yield path


def mark_finished(root: Path) -> None:
    """The run whose one-off overrides occupy params.yaml ended as it should (not killed)."""
    note = _note(root)
    if note:
        write_text_atomic(root / RUN_NOTE, json.dumps({**note, "finished": True}))


def restore_own_settings(root: Path) -> list[str]:
    """Whatever runs next after a run with one-off overrides (finished, failed or killed at any moment): params.yaml
    is the user's own again, with the user's edits since, before anything else; one line says so. Files the
    bookkeeping left (`.params.base.yaml`, `.params.run.json`), whole, cut short or alone, are recovered and removed.
    The caller holds the repository's run lock, so no live run owns them."""
    params, base, note = root / "params.yaml", root / BASE_FILE, root / RUN_NOTE
    if not base.exists():
        note.unlink(missing_ok=True)  # a note alone: its base was put back by a run killed before removing it
        return []
    said = []
    if not _readable(base.read_text()):  # a base cut short (written in place by an older version): not trusted
        kept = root / "logs" / "params-base-cut-short.yaml"
        kept.parent.mkdir(parents=True, exist_ok=True)
        base.replace(kept)
        said.append(f"params.yaml: kept as it is; your own settings kept beside it ({BASE_FILE}) were cut short by a "
                    f"kill (moved to {kept.relative_to(root)}); check params.yaml before the next run")
    else:
        own, text = _own_settings(root)
        if str(KILLED_COPY) in text and params.exists():
            write_text_atomic(root / KILLED_COPY, params.read_text(errors="replace"))
        if own is not None:
            write_text_atomic(params, own)
        if text:
            said.append(text)
        base.unlink()
    note.unlink(missing_ok=True)
    return said


def prepare_params(root: Path, overlays: list[Path], overrides: list[str], persist: bool,
                   described: str = "") -> list[str]:
    """Make params.yaml this run's configuration: the user's own (first put back when an earlier run's one-off
    overrides still occupy it, the user's edits since kept: `restore_own_settings`) plus this run's overrides.
    Returns what to print. Without `persist` the user's own is kept in `.params.base.yaml` for the next plain run;
    the user's own and the note are on disk before params.yaml changes, each in one rename, so a kill at any moment
    leaves what the next run needs to put the user's own back."""
    params, base, note = root / "params.yaml", root / BASE_FILE, root / RUN_NOTE
    said = restore_own_settings(root)
    if not overlays and not overrides:
        return said
    text = render_params(params, overlays, overrides)
    if text is None:
        return said
    if persist:
        write_text_atomic(params, text)
        said.append(f"params.yaml updated with the run's settings for good (--persist; git diff {params.name} "
                    "shows them)")
        return said
    write_text_atomic(base, params.read_text())
    write_text_atomic(note, json.dumps({"sha256": _sha256(text.encode()), "overrides": described, "applied": text,
                                        "finished": False, "at": time.strftime("%Y-%m-%d %H:%M:%S")}))
    write_text_atomic(params, text)
    said.append("params.yaml holds this run's settings, so `dvc repro` reproduces it; the next run without "
                f"overrides goes back to your own (kept as {BASE_FILE}); add --persist to keep them")
    return said


def _merge_roundtrip(doc: Any, overlay: dict[str, Any]) -> None:
    for key, value in overlay.items():
        if isinstance(value, dict) and isinstance(doc.get(key), dict):
            _merge_roundtrip(doc[key], value)
        else:
            doc[key] = value
