"""Settings records: dataclasses whose fields are `grpo.*` keys of the same names, each field with its default and
the rule every configured value keeps. The losses (components/losses.py) and the rollout engines
(components/rollout_engines.py) each carry one; `GRPOConfig` inherits every record's fields."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Iterator
from typing import Any


def setting(default: Any, rule: str, valid: Callable[[Any], bool]) -> Any:
    """A field of a settings record: its default (the `grpo.*` key's) and the rule every configured value keeps."""
    return dataclasses.field(default=default, metadata={"rule": (valid, rule)})


def settings_keys(record: type) -> list[str]:
    """The `grpo.*` keys (field names) of a settings record."""
    return [f.name for f in dataclasses.fields(record)]


def rules_of(records: Iterable[type]) -> Iterator[tuple[str, Callable[[Any], bool], str]]:
    """(key, valid, rule) for every field of `records` that keeps a rule."""
    for record in records:
        for f in dataclasses.fields(record):
            if "rule" in f.metadata:
                yield f.name, *f.metadata["rule"]


def read_record(record: type, config: Any) -> Any:
    """`record` with each field read from `config`'s attribute of the same name (`GRPOConfig`)."""
    return record(**{f.name: getattr(config, f.name) for f in dataclasses.fields(record)})
