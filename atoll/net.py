"""Whether an address is this machine's own (a loopback name or address): the admin port refuses to
listen beyond it without a token, and records stream only to an object store that is not on it."""

from __future__ import annotations

import ipaddress


def is_loopback_host(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
