"""Errors every ``atoll`` command shares."""

from __future__ import annotations


class UserError(Exception):
    """An error for the user, printed as one line (``atoll <command>: error: ...``), exit 1."""


class PortInUse(UserError, OSError):
    """A port a server was told to bind is taken (another coordinator serves it): one line naming it."""
