"""DVC's YAML files parsed once per text, not once per read.

Each stage a run reproduces opens the repository again, and DVC reads dvc.yaml, dvc.lock and params.yaml several
times per stage (collecting the stages, checking each one's dependencies, writing its lock entry): dozens of parses
of the same few texts per run, with ruamel.yaml's constructor and resolver in Python. Inside `yaml_parsed_once`,
DVC's safe parser (`parse_yaml`, typ "safe") keeps each text's result and hands out a deep copy of it when the same
text comes again, so a caller that changes what it got changes only its copy. Round-trip parses (typ "rt", which
DVC uses to edit a file in place and whose objects carry comments) are not cached. A text is the whole key: a file
that changed is parsed again.
"""

from __future__ import annotations

import contextlib
import copy
from collections import OrderedDict
from collections.abc import Callable, Iterator
from typing import Any

CACHED_TEXTS = 16  # a run's YAML files (dvc.yaml, params.yaml, dvc.lock as it grows) with room to spare
_parsed: OrderedDict[str, Any] = OrderedDict()


def _parsed_once(parse: Callable[..., Any]) -> Callable[..., Any]:
    def parse_yaml(text: str, path: Any, typ: str = "safe") -> Any:
        if typ != "safe":
            return parse(text, path, typ=typ)
        if text not in _parsed:
            _parsed[text] = parse(text, path, typ=typ)  # a parse error raises: nothing is kept
            while len(_parsed) > CACHED_TEXTS:
                _parsed.popitem(last=False)
        _parsed.move_to_end(text)
        return copy.deepcopy(_parsed[text])

    return parse_yaml


@contextlib.contextmanager
def yaml_parsed_once() -> Iterator[None]:
    """While the body runs, DVC's safe YAML parses go through the cache (every module that holds `parse_yaml`)."""
    from dvc.utils import serialize, strictyaml
    from dvc.utils.serialize import _yaml

    holders = [module for module in (_yaml, serialize, strictyaml) if hasattr(module, "parse_yaml")]
    original = _yaml.parse_yaml
    cached = _parsed_once(original)
    for module in holders:
        module.parse_yaml = cached
    try:
        yield
    finally:
        for module in holders:
            module.parse_yaml = original
