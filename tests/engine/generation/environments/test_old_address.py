"""User environments written against the environment protocol's former address keep working, and are told where it
lives now."""

from __future__ import annotations

import importlib
import sys

import pytest


def test_the_former_address_gives_the_same_protocol_and_warns():
    from components.engine.generation.environments.environment import EnvironmentStep

    sys.modules.pop("components.engine.environments.environment", None)
    with pytest.warns(DeprecationWarning, match="components.engine.generation.environments.environment"):
        old = importlib.import_module("components.engine.environments.environment")
    assert old.EnvironmentStep is EnvironmentStep
