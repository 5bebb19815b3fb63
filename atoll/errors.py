"""Errors every ``atoll`` command shares."""

from __future__ import annotations


class UserError(Exception):
    """An error for the user, printed as one line (``atoll <command>: error: ...``), exit 1."""
