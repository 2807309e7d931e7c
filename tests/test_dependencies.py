"""Every library the package imports is declared in pyproject.toml, and every declared dependency is imported
(or named below with the reason it is declared): an install from pyproject alone runs, and nothing is carried
that nothing uses."""

from __future__ import annotations

import ast
import functools
import importlib.metadata
import sys
import tomllib

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from conftest import ROOT

PACKAGES = ("components", "pipelines")
# Declared, never imported: pins on what other packages pull in.
DECLARED_FOR_A_PIN = {
    "fastapi": "Prefect 3.8's server fails on FastAPI >= 0.151",
    "sqlalchemy": "Prefect's scheduler fails on SQLAlchemy 2.1",
}
# Imported by an optional code path whose distribution the test environment does not install.
NOT_INSTALLED_HERE = {"prefect_ray": "prefect-ray"}
# The project's own code under another name: the package a registered model ships (tracking/registered_model.py), and
# the code sandbox's child-side modules, copied beside the child and imported top-level there (rewards/sandbox.py).
SHIPPED = {"grpo_served", "audit_guard", "confinement"}


def declared() -> tuple[set[str], set[str]]:
    """(core dependencies, core + every extra), as canonical distribution names."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]

    def names(reqs):
        return {canonicalize_name(Requirement(r).name) for r in reqs}

    core = names(project["dependencies"])
    extras = set().union(*(names(reqs) for reqs in project["optional-dependencies"].values()))
    extras |= {canonicalize_name(f"{Requirement(r).name}-{extra}") for reqs in project["optional-dependencies"].values()
               for r in reqs for extra in Requirement(r).extras}  # prefect[ray] provides prefect-ray
    return core, core | extras


def imported_modules() -> dict[str, str]:
    """Top-level third-party module -> a file importing it, over every import statement (lazy ones included) and
    every `find_spec("name")` of components/ and pipelines/."""
    found: dict[str, str] = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.Import):
                    names = [alias.name for alias in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    names = [node.module]
                elif (isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "find_spec" and node.args
                      and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
                    names = [node.args[0].value]
                else:
                    continue
                for name in names:
                    top = name.split(".")[0]
                    if top not in sys.stdlib_module_names and top not in PACKAGES and top not in SHIPPED:
                        found.setdefault(top, str(path.relative_to(ROOT)))
    return found


@functools.cache
def _installed() -> dict[str, list[str]]:
    return importlib.metadata.packages_distributions()


def distributions(module: str) -> set[str]:
    dists = _installed().get(module) or [NOT_INSTALLED_HERE.get(module, "")]
    return {canonicalize_name(d) for d in dists if d}


def test_every_imported_library_is_declared():
    core, everything = declared()
    undeclared = {module: where for module, where in imported_modules().items()
                  if not distributions(module) & everything}
    assert not undeclared, f"imported but not in pyproject.toml's dependencies or extras: {undeclared}"


def test_every_declared_dependency_is_imported_or_a_named_pin():
    core, _ = declared()
    used = set().union(*(distributions(module) for module in imported_modules()))
    unused = core - used - set(DECLARED_FOR_A_PIN)
    assert not unused, f"declared in pyproject.toml, imported nowhere in {PACKAGES}: {sorted(unused)}"
    assert set(DECLARED_FOR_A_PIN) <= core, "a pin listed here is no longer declared: drop it from the list"
