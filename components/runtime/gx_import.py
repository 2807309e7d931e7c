"""`import components.runtime.gx_import` is `import great_expectations`, with two of its libraries loaded on first use.

Importing Great Expectations imports every expectation class it ships. One of them,
`ExpectColumnKLDivergenceToBeLessThan`, imports scipy.stats and altair at module level for its
statistics and its charts: 0.8-1.2 of the package's 2.1-2.6 CPU-seconds of import (measured), paid by the
`validate` stage (and the warm stage server's level that serves it) while the pipeline's start-up
keeps both cores busy. The suites here never use that expectation. The two modules are bound
where GX imports them but only loaded when something reads an attribute of them, so a suite that
does use them still gets the real modules.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import types

DEFERRED = ("scipy.stats", "altair")


class DeferredModule(types.ModuleType):
    """Stands in `sys.modules` for a module until one of its attributes is read, then imports it.

    The import machinery itself reads only `__spec__` (already set), so `import x` and `from p
    import x` bind this stand-in without loading anything. Unlike `importlib.util.LazyLoader`,
    whose module loads as soon as Python 3.11's `import` statement checks its `__spec__`.
    """

    def __init__(self, spec: importlib.machinery.ModuleSpec) -> None:
        super().__init__(spec.name)
        self.__spec__, self.__loader__, self.__file__ = spec, spec.loader, spec.origin
        self.__package__ = spec.name if spec.submodule_search_locations is not None else spec.parent

    def __getattr__(self, attribute: str):  # only reached for what __init__ did not set
        return getattr(self._load(), attribute)

    def __dir__(self) -> list[str]:
        return dir(self._load())

    def _load(self) -> types.ModuleType:
        real = self.__dict__.get("_loaded")
        if real is None:
            parent_name, _, child = self.__name__.rpartition(".")
            if sys.modules.get(self.__name__) is self:
                del sys.modules[self.__name__]
            parent = sys.modules.get(parent_name) if parent_name else None
            if parent is not None and parent.__dict__.get(child) is self:
                delattr(parent, child)
            real = importlib.import_module(self.__name__)  # sets sys.modules and the parent's attribute again
            self.__dict__["_loaded"] = real
        return real


def defer(name: str) -> None:
    """Put a DeferredModule for `name` in place, unless it is imported already or not installed."""
    if name in sys.modules:
        return
    try:
        spec = importlib.util.find_spec(name)  # imports the parent package (scipy: cheap, MLflow has it)
    except (ImportError, ValueError):
        return
    if spec is None:
        return
    module = DeferredModule(spec)
    sys.modules[name] = module
    parent_name, _, child = name.rpartition(".")
    if parent_name:
        setattr(sys.modules[parent_name], child, module)


for _name in DEFERRED:
    defer(_name)

import great_expectations  # noqa: E402 - after the deferrals above, which are this module's point

__all__ = ["great_expectations", "DeferredModule", "defer"]
