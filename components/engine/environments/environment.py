"""`from components.engine.environments.environment import EnvironmentStep`, as docs before the move said, still works
and warns once: import it from `components.engine.generation.environments.environment`."""

from __future__ import annotations

import warnings

from components.engine.generation.environments.environment import Environment, EnvironmentStep

__all__ = ["Environment", "EnvironmentStep"]

warnings.warn("components.engine.environments.environment moved to components.engine.generation.environments."
              "environment; import EnvironmentStep from there", DeprecationWarning, stacklevel=2)
