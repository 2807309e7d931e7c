"""The config's one error and its one check: `ConfigError` names the offending key, `_require` raises it
with the rule that key broke. Every section module builds on these two."""

from __future__ import annotations


class ConfigError(ValueError):
    """A params key is unknown, mistyped or out of range; the message names the key."""


def _require(condition: bool, key: str, rule: str) -> None:
    if not condition:
        raise ConfigError(f"{key}: {rule}")
