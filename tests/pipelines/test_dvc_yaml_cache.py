"""pipelines/dvc_yaml_cache.py: inside `yaml_parsed_once` DVC parses each YAML text once, every reader gets data of
its own, round-trip parses and changed files are parsed afresh, and DVC's parser is put back after the block. A real
DVC repository reproduced through DVC's Python API as the flow does, and DVC's own loaders."""

from __future__ import annotations

from test_dvc_lockfile import DVC_YAML, PARAMS, dvc_repo, lock_data, reproduce


def counting_parses(monkeypatch) -> list[str]:
    """The texts ruamel.yaml actually parses for DVC (`YAML.load`), in order."""
    from ruamel.yaml import YAML

    parsed: list[str] = []
    load = YAML.load

    def counted(self, stream):
        parsed.append(stream if isinstance(stream, str) else "<stream>")
        return load(self, stream)

    monkeypatch.setattr(YAML, "load", counted)
    return parsed


def test_each_text_is_parsed_once_and_every_reader_gets_its_own_copy(tmp_path, monkeypatch):
    from dvc.utils import strictyaml
    from dvc.utils.serialize import _yaml, load_yaml

    from pipelines.dvc_yaml_cache import yaml_parsed_once

    (tmp_path / "params.yaml").write_text(PARAMS)
    parsed = counting_parses(monkeypatch)
    original = _yaml.parse_yaml
    with yaml_parsed_once():
        first = load_yaml(tmp_path / "params.yaml")
        first["lr"] = "changed by its reader"
        second = load_yaml(tmp_path / "params.yaml")
        via_schema = strictyaml.load(str(tmp_path / "params.yaml"))[0]  # DVC's dvc.yaml reader, the same parser
        assert parsed.count(PARAMS) == 1
        assert second == via_schema == {"lr": 1e-05, "name": "yes", "flags": ["on", "off", 3]}  # YAML 1.2
        _yaml.parse_yaml_for_update(PARAMS, "params.yaml")  # round trip: objects that carry comments, not cached
        assert parsed.count(PARAMS) == 2
        (tmp_path / "params.yaml").write_text(PARAMS.replace("1e-05", "2e-05"))  # another text: parsed again
        assert load_yaml(tmp_path / "params.yaml")["lr"] == 2e-05
    assert _yaml.parse_yaml is original and strictyaml.parse_yaml is original
    load_yaml(tmp_path / "params.yaml")
    load_yaml(tmp_path / "params.yaml")
    assert parsed.count(PARAMS.replace("1e-05", "2e-05")) == 3  # after the block: every read parses again


def test_a_reproduced_pipeline_records_the_same_lock_file_with_fewer_parses(tmp_path, monkeypatch):
    """The flow's setting (lock files without DVC's round trip) with the cache and without: the same dvc.lock, byte
    for byte, and fewer parses with it."""
    from pipelines.dvc_yaml_cache import yaml_parsed_once

    parsed = counting_parses(monkeypatch)
    plain = dvc_repo(tmp_path / "plain")
    reproduce(plain, without_round_trip=True)
    parses_without = len(parsed)
    cached = dvc_repo(tmp_path / "cached")
    with yaml_parsed_once():
        reproduce(cached, without_round_trip=True)
    parses_with = len(parsed) - parses_without
    assert (cached / "dvc.lock").read_text() == (plain / "dvc.lock").read_text()
    assert lock_data(cached) == lock_data(plain) and (cached / "dvc.yaml").read_text() == DVC_YAML
    assert parses_with < parses_without, (parses_with, parses_without)
