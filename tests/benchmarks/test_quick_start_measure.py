"""benchmarks/quick_start.py measures the install as an unconfigured machine runs it: pip without this machine's
configuration (mirrors, wheel folders, constraints), PyPI and the Makefile's CPU index of torch, a new empty cache;
and what it writes, and the README's rendering of it, names no path of the machine that measured."""

from __future__ import annotations

import json
import os

from benchmarks import quick_start as qs
from benchmarks.render_results import quick_start_figures


def test_pip_runs_with_its_defaults_and_a_new_empty_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("PIP_FIND_LINKS", "/opt/wheels")
    monkeypatch.setenv("PIP_EXTRA_INDEX_URL", "file:///opt/pypi/simple")
    monkeypatch.setenv("PIP_CERT", "/etc/ssl/certs/ca-certificates.crt")
    env = qs.stranger_env(tmp_path)
    assert env["PIP_CONFIG_FILE"] == os.devnull and env["PIP_CACHE_DIR"] == str(tmp_path / "pip-cache")
    assert "PIP_FIND_LINKS" not in env and "PIP_EXTRA_INDEX_URL" not in env and env["PIP_CERT"]
    # what pip itself reports under that environment (a real `pip config list`)
    assert qs.package_sources(env, cpu_torch=True) == ["https://download.pytorch.org/whl/cpu",
                                                      "https://pypi.org/simple"]
    assert qs.pip_cache_bytes(env) == 0


def test_a_local_package_source_is_refused_and_never_printed():
    assert qs.local_sources(["/opt/wheels", "file:///opt/pypi/simple", "https://pypi.org/simple"]) == [
        "/opt/wheels", "file:///opt/pypi/simple"]
    assert qs.local_sources(["https://pypi.org/simple", "https://download.pytorch.org/whl/cpu"]) == []


def test_the_readme_names_no_path_of_the_measuring_machine(monkeypatch, tmp_path):
    import benchmarks.render_results as rr

    result = json.loads((qs.RESULTS / "quick_start.json").read_text())
    result["install"]["package_sources"] = ["/opt/wheels", "file:///opt/pypi/simple", "https://pypi.org/simple"]
    (tmp_path / "quick_start.json").write_text(json.dumps(result))
    monkeypatch.setattr(rr, "RESULTS", tmp_path)
    text = quick_start_figures()
    assert "/opt" not in text and "file://" not in text and "own package mirrors, not the default sources" in text


def test_this_machines_sources_are_kept_only_when_asked_and_recorded_without_their_paths(tmp_path, monkeypatch):
    """A machine that cannot reach PyPI measures with its own sources, and the results never name them."""
    monkeypatch.setenv("PIP_FIND_LINKS", "/opt/wheels")
    assert "PIP_FIND_LINKS" not in qs.stranger_env(tmp_path)
    env = qs.stranger_env(tmp_path, keep_sources=True)
    assert env["PIP_FIND_LINKS"] == "/opt/wheels"
    assert qs.recorded_sources(qs.package_sources(env, cpu_torch=True)) == [
        "a local package source", "https://download.pytorch.org/whl/cpu", "https://pypi.org/simple"]
