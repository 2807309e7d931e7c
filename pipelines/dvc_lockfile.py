"""dvc.lock rewritten after each stage by ruamel.yaml's C-backed safe loader and dumper instead of its round trip.

After every stage it runs, DVC reads the whole lock file again with ruamel.yaml's round-trip loader (which keeps
comments and each scalar's quoting) and writes it back with the round-trip dumper. On this project's lock file (seven
stages, hundreds of dependency entries) that is most of DVC's own work per stage, and it lies on the flow's path
between stages. A lock file is DVC's output, not a file people edit, so inside `lock_files_without_round_trip` DVC
reads it with ruamel's safe loader, the YAML 1.2 reader DVC itself reads lock files with, and writes it with ruamel's
safe dumper set up as DVC's own (block style, keys in DVC's order): the same data, each entry laid out as DVC writes a
new one (an entry DVC's round trip carries over writes a null as an empty value; here as `null`); what it does not
carry over is what a lock file should not hold (comments, hand-chosen quoting). Every other file DVC modifies
(dvc.yaml, which users write) keeps DVC's round trip.
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections import OrderedDict
from collections.abc import Iterator
from typing import IO, Any

LOCK_SUFFIX = ".lock"  # dvc.lock, or NAME.lock beside a pipeline file NAME.yaml


@functools.cache
def _lock_representer() -> type:
    """ruamel's safe representer with DVC's OrderedDicts as mappings; a subclass, so the representer other ruamel
    users get stays as it was."""
    from ruamel.yaml.representer import SafeRepresenter

    class LockRepresenter(SafeRepresenter):
        pass

    LockRepresenter.add_representer(OrderedDict, SafeRepresenter.represent_dict)
    return LockRepresenter


def _lock_yaml() -> Any:
    """ruamel.yaml's safe loader and dumper (libyaml's parser and emitter where ruamel.yaml.clib is installed), set
    up as DVC's round-trip dumper is: block style, mappings in their own order, DVC's OrderedDicts as mappings."""
    from ruamel.yaml import YAML

    yaml = YAML(typ="safe", pure=False)
    yaml.Representer = _lock_representer()
    yaml.default_flow_style = False
    yaml.sort_base_mapping_type_on_output = False
    return yaml


def _parse(text: str, path: str) -> Any:
    from dvc.utils.serialize._yaml import YAMLFileCorruptedError
    from ruamel.yaml import YAMLError

    try:
        return _lock_yaml().load(text) or {}
    except YAMLError as err:
        raise YAMLFileCorruptedError(path) from err


def _dump(data: Any, stream: IO[str]) -> None:
    _lock_yaml().dump(data, stream)


@contextlib.contextmanager
def _modify_lock_file(path: Any, fs: Any = None) -> Iterator[Any]:
    """DVC's `modify_yaml` (load, let the caller change the data, write it back) with the safe loader and dumper."""
    from dvc.utils.serialize._common import _modify_data

    with _modify_data(path, _parse, _dump, fs=fs) as data:
        yield data


@contextlib.contextmanager
def lock_files_without_round_trip() -> Iterator[None]:
    """While the body runs, DVC rewrites lock files (and only lock files) through `_modify_lock_file`."""
    from dvc import dvcfile

    round_trip = dvcfile.modify_yaml

    def modify_yaml(path: Any, fs: Any = None) -> contextlib.AbstractContextManager:
        is_lock = os.path.splitext(os.fspath(path))[1] == LOCK_SUFFIX
        return (_modify_lock_file if is_lock else round_trip)(path, fs=fs)

    dvcfile.modify_yaml = modify_yaml
    try:
        yield
    finally:
        dvcfile.modify_yaml = round_trip
