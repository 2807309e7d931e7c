"""dvc.yaml is complete: every stage depends on every project module it imports, and lists the params
the code keys its resumable state to.

A module missing from a stage's `deps` means a change to it leaves DVC reporting the stage as up to
date although its result would change (a `fastlm.py` change once moved the headline result unseen).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import yaml

from components.config import STAGE_PARAMS
from components.rollout_engines import ENGINES
from components.runtime.stage_server import STAGE_MODULES

ROOT = Path(__file__).resolve().parent.parent
DVC = yaml.safe_load((ROOT / "dvc.yaml").read_text())["stages"]


def project_imports(module: str) -> set[str]:
    """Project modules `module` imports, directly or through others, at any depth and in any scope."""
    seen: set[str] = set()
    todo = [module]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        path = module_file(name)
        if path is None:
            continue
        seen.add(name)
        if name == "components.engine.generation.engines.choose":  # builds the engines by name from their registry
            todo += [entry.module_path for entry in ENGINES.values()]
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                todo += [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                todo.append(node.module)
                todo += [f"{node.module}.{alias.name}" for alias in node.names]  # submodules imported by name
    return seen


def module_file(name: str) -> Path | None:
    if not name.startswith(("components", "pipelines")):
        return None
    base = ROOT.joinpath(*name.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.exists():
            return candidate
    return None


def covered(path: Path, deps: list[str]) -> bool:
    rel = path.relative_to(ROOT)
    return any(rel == Path(dep) or Path(dep) in rel.parents for dep in deps)


@pytest.mark.parametrize("stage", sorted(STAGE_MODULES))
def test_every_imported_project_module_is_a_dependency(stage):
    deps = [d if isinstance(d, str) else next(iter(d)) for d in DVC[stage]["deps"]]
    modules = project_imports(f"components.{STAGE_MODULES[stage]}")
    missing = sorted(str(module_file(m).relative_to(ROOT)) for m in modules
                     if not covered(module_file(m), deps) and not module_file(m).name == "__init__.py")
    assert not missing, f"dvc.yaml stage {stage!r} imports but does not depend on: {missing}"


def test_the_closure_follows_imports_inside_functions():
    # evaluate imports components.tracking.runs inside a function; grpo reaches fastlm through its imports.
    assert "components.tracking.runs" in project_imports("components.stages.evaluate")
    assert "components.engine.generation.fast.fastlm" in project_imports("components.stages.grpo")
    # choose.py imports no engine: it builds each registered one by its module's name.
    assert "components.engine.generation.engines.cuda_graphs" in project_imports("components.stages.evaluate")


@pytest.mark.parametrize("stage", sorted(STAGE_MODULES))
def test_stage_params_match_the_code(stage):
    assert [p if isinstance(p, str) else next(iter(p)) for p in DVC[stage].get("params", [])] \
        == list(STAGE_PARAMS[stage])
