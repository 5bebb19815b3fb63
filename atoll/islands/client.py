"""Deprecated: import the client from :mod:`atoll.islands` (``CoordinatorClient``, ``RetryPolicy``,
``ClientTls``); the module that holds it is internal. ``from atoll.islands.client import
CoordinatorClient`` still works in this release and warns, naming the new place."""

from __future__ import annotations

import warnings

from atoll.islands._transport import client as _client

MOVED = (
    "ClientTls",
    "CoordinatorClient",
    "PartialUpdate",
    "ProtocolError",
    "RetryPolicy",
    "parse_address",
    "parse_addresses",
)


PUBLIC = frozenset({"ClientTls", "CoordinatorClient", "RetryPolicy"})
"""What :mod:`atoll.islands` exports; the others were never meant for users and are internal now."""


def __getattr__(name: str):
    if name in MOVED:
        where = "import it from atoll.islands" if name in PUBLIC else "it is internal now"
        warnings.warn(f"atoll.islands.client.{name} is deprecated: {where}", DeprecationWarning, stacklevel=2)
        return getattr(_client, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
