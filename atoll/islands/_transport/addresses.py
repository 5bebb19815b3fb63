"""Where the coordinator is, as the island is told: ``host:port`` (or ``[ipv6]:port``), its shards
comma-separated, each with standbys after ``|``; every one checked, with a message saying what is wrong."""

from __future__ import annotations

import re

_ADDRESS = re.compile(r"^(?:\[(?P<v6>[0-9A-Fa-f:.]+)\]|(?P<host>[A-Za-z0-9_.-]+)):(?P<port>[0-9]{1,5})$")


def parse_address(address: str) -> tuple[str, int]:
    """``host:port`` or ``[ipv6]:port`` -> (host, port); ValueError saying what is wrong otherwise."""
    a = address.strip()
    if "://" in a:
        raise ValueError(f"coordinator address {address!r}: give host:port, without a scheme ({a.split('://')[0]}://)")
    m = _ADDRESS.match(a)
    if m is None:
        if a and ":" not in a:
            raise ValueError(f"coordinator address {address!r} has no port: give host:port, e.g. {a}:7070")
        raise ValueError(f"coordinator address {address!r} is not host:port (e.g. coord.example:7070, [::1]:7070)")
    port = int(m.group("port"))
    if not 0 < port < 65536:
        raise ValueError(f"coordinator address {address!r}: port {port} is outside 1..65535")
    return m.group("v6") or m.group("host"), port


def parse_addresses(coordinator: str) -> list[str]:
    """A coordinator, or its shards comma-separated, each validated (ValueError). Each may name
    standbys after ``|`` (``coord-a:7070|coord-b:7070``): where the run's state is in an object store,
    a coordinator on another machine takes over the run (:func:`alternatives`)."""
    addresses = [a.strip() for a in coordinator.split(",") if a.strip()]
    if not addresses:
        raise ValueError("coordinator must be host:port, or a comma-separated list of its shards")
    for a in addresses:
        alternatives(a)
    return addresses


def alternatives(address: str) -> list[str]:
    """``host:port``, or several ``|``-separated (one coordinator and its standbys), each validated."""
    out = [a.strip() for a in address.split("|")]
    for a in out:
        parse_address(a)
    return out
