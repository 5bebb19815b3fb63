"""Regions of a global tensor: the piece of it one rank's shard covers (:class:`Region`, a protocol
message both ends share), and whether the shards of all ranks tile a tensor."""

from __future__ import annotations

import math

from atoll.protos.messages import Region

__all__ = ["Region", "check_coverage"]


def check_coverage(name: str, shape: tuple[int, ...], regions: list[Region]) -> None:
    """Raise ValueError unless ``regions`` tile the tensor exactly once."""
    total = sum(r.numel for r in regions)
    if total != math.prod(shape):
        raise ValueError(f"tensor {name!r}: shards cover {total} of {math.prod(shape)} elements")
    nonempty = [r for r in regions if r.numel]
    for i, a in enumerate(nonempty):
        for b in nonempty[i + 1 :]:
            if a.overlaps(b):
                raise ValueError(f"tensor {name!r}: shards {a} and {b} overlap")
