"""Deprecated: the client moved to :mod:`atoll.islands.transport.client` (and stays importable from
:mod:`atoll.islands`). ``from atoll.islands.client import CoordinatorClient`` still works in this
release and warns once, naming the new place."""

from __future__ import annotations

import warnings

from atoll.islands.transport import client as _client

MOVED = (
    "ClientTls",
    "CoordinatorClient",
    "PartialUpdate",
    "ProtocolError",
    "RetryPolicy",
    "parse_address",
    "parse_addresses",
)


def __getattr__(name: str):
    if name in MOVED:
        warnings.warn(
            f"atoll.islands.client.{name} moved: import it from atoll.islands (or atoll.islands.transport.client)",
            DeprecationWarning,
            stacklevel=2,
        )
        return getattr(_client, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
