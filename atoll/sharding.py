"""Which coordinator shard owns a tensor: a fixed, stable function of its name.

Islands and coordinator shards compute it independently (no shard map service): with ``n``
shards, tensor ``name`` belongs to shard ``crc32(name) % n``.
"""

from __future__ import annotations

import zlib


def shard_of(name: str, num_shards: int) -> int:
    if num_shards < 1:
        raise ValueError(f"num_shards must be >= 1, got {num_shards}")
    return zlib.crc32(name.encode()) % num_shards


def parse_shard(spec: str) -> tuple[int, int]:
    """``"i/n"`` -> (i, n), e.g. ``--shard 0/2``."""
    try:
        i, n = (int(x) for x in spec.split("/"))
    except ValueError:
        raise ValueError(f"shard must look like i/n (e.g. 0/2), got {spec!r}") from None
    if not (n >= 1 and 0 <= i < n):
        raise ValueError(f"shard {spec!r}: need 0 <= i < n")
    return i, n
