"""The floors of docs/architecture.md hold: import-linter's contracts (pyproject.toml) are kept, and no
project module imports itself through others (no import loop, inside a floor or across floors)."""

from __future__ import annotations

import grimp
from importlinter.cli import lint_imports

from conftest import ROOT


def test_import_linter_contracts_are_kept():
    # Floors (pipelines > runtime > stages > tracking > engine > data > config, errors, ...), stages
    # independent of each other, and no Prefect in the library. Exit code 1 names the broken import.
    assert lint_imports(config_filename=str(ROOT / "pyproject.toml"), no_cache=True, no_logo=True) == 0


def import_loops(graph) -> list[list[str]]:
    """Strongly connected groups of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    loops: list[list[str]] = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        on_stack.add(module)
        for other in graph.find_modules_directly_imported_by(module):
            if other not in graph.modules:
                continue
            if other not in index:
                visit(other)
                low[module] = min(low[module], low[other])
            elif other in on_stack:
                low[module] = min(low[module], index[other])
        if low[module] == index[module]:
            group = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                group.append(member)
                if member == module:
                    break
            if len(group) > 1:
                loops.append(sorted(group))

    for module in sorted(graph.modules):
        if module not in index:
            visit(module)
    return loops


def test_no_import_loops():
    graph = grimp.build_graph("components", "pipelines")
    assert import_loops(graph) == []


def test_the_loop_finder_finds_a_loop():
    graph = grimp.build_graph("components", "pipelines")
    graph.add_import(importer="components.config", imported="components.engine.rewards.rewards")  # the loop that was
    loop = ["components.config", "components.engine.models.modeling", "components.engine.rewards.rewards"]
    assert loop in import_loops(graph)


def test_the_engine_floors_are_checked(tmp_path):
    """The engine's floors contract is not vacuous: with its floors reversed, its real imports break it."""
    config = (ROOT / "pyproject.toml").read_text()
    floors = '    "grpo",\n    "evaluation",\n    "fast | rewards | parallel",\n    "models",\n'
    assert floors in config
    reversed_floors = '    "models",\n    "fast | rewards | parallel",\n    "evaluation",\n    "grpo",\n'
    (tmp_path / "pyproject.toml").write_text(config.replace(floors, reversed_floors))
    assert lint_imports(config_filename=str(tmp_path / "pyproject.toml"), no_cache=True, no_logo=True) == 1


def test_the_fast_path_has_one_door():
    graph = grimp.build_graph("components", "pipelines")
    importers = {m for m in graph.find_modules_that_directly_import("components.engine.fast.fastlm")
                 if not m.startswith("components.engine.fast")}
    assert importers == {"components.engine.grpo.policy"}
