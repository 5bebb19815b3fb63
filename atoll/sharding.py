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


PARTITIONS = ("hash", "layers")
"""How tensors map to coordinator shards: ``hash`` (crc32 of the name, any subset of the model per
shard) or ``layers`` (contiguous blocks of parameters in model order, balanced by element count:
the fragments of Streaming DiLoCo)."""


def layer_partition(tensors: list[tuple[str, int]], num_shards: int) -> dict[str, int]:
    """``[(name, numel), ...]`` in model order -> {name: fragment}: contiguous, balanced by size.

    A tensor goes to the fragment its midpoint falls in, so fragments hold about 1/n of the
    elements each (as far as tensor boundaries allow). Every island computes it from the same
    model, so islands agree without a shard map service.
    """
    if num_shards < 1:
        raise ValueError(f"num_shards must be >= 1, got {num_shards}")
    total = sum(numel for _, numel in tensors)
    if total == 0:
        raise ValueError("cannot partition a model with no elements")
    out, before = {}, 0
    for name, numel in tensors:
        out[name] = min(num_shards - 1, int((before + numel / 2) * num_shards // total))
        before += numel
    empty = sorted(set(range(num_shards)) - set(out.values()))
    if empty:
        raise ValueError(f"fragments {empty} of {num_shards} would hold no tensors; use fewer fragments")
    return out


def layout_digest(tensors: list[tuple[str, tuple[int, ...]]]) -> str:
    """A short digest of the model's tensor names and shapes, in order (islands must agree on it)."""
    h = zlib.crc32(b"")
    for name, shape in tensors:
        h = zlib.crc32(f"{name}:{','.join(map(str, shape))};".encode(), h)
    return f"{h:08x}-{len(tensors)}"
