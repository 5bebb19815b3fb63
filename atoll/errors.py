"""Errors every ``atoll`` command shares."""

from __future__ import annotations


class UserError(Exception):
    """An error for the user, printed as one line (``atoll <command>: error: ...``), exit 1."""

    exit_code = 1


class BadInput(UserError):
    """What the command was given cannot work (a standby pointed at a URL with no run): one line, exit 2,
    as a bad flag (without the usage, which says nothing about it)."""

    exit_code = 2


class PortInUse(UserError, OSError):
    """A port a server was told to bind is taken (another coordinator serves it): one line naming it."""
