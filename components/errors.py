"""The error every layer may raise when a run must stop with a message for the user (not a traceback)."""

from __future__ import annotations


class StageFailed(RuntimeError):
    """A stage refused its inputs; the message is the whole report a user needs."""
