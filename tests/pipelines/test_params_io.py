"""Writing a run's overrides into params.yaml: only what changed, in the file's own style."""

from __future__ import annotations

from pipelines.params_io import apply_to_params

from conftest import ROOT


def test_a_run_without_overrides_leaves_params_yaml_byte_identical(tmp_path):
    params = tmp_path / "params.yaml"
    original = (ROOT / "params.yaml").read_bytes()
    params.write_bytes(original)
    assert apply_to_params(params, [], []) is False and params.read_bytes() == original
    # An override to the value it already has changes nothing either (same nulls, same list style).
    assert apply_to_params(params, [], ["seed=1234", "grpo.kl_beta=0.04"]) is False
    assert params.read_bytes() == original


def test_an_override_changes_its_own_line_only(tmp_path):
    params = tmp_path / "params.yaml"
    original = (ROOT / "params.yaml").read_text()
    params.write_text(original)
    assert apply_to_params(params, [], ["seed=7"]) is True
    changed = [(a, b) for a, b in zip(original.splitlines(), params.read_text().splitlines()) if a != b]
    assert changed == [("seed: 1234", "seed: 7")] and len(params.read_text().splitlines()) == len(original.splitlines())
    assert "  train_path: null" in params.read_text()  # ruamel's default would write an empty value
