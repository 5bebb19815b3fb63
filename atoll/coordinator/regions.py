"""Regions of a global tensor: the piece of it one rank's shard covers."""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Region:
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]

    @classmethod
    def full(cls, shape: tuple[int, ...]) -> Region:
        return cls(tuple(0 for _ in shape), tuple(shape))

    @classmethod
    def parse(cls, offsets, sizes, shape: tuple[int, ...]) -> Region:
        """Validate a region sent on the wire against the tensor's shape (empty = whole tensor)."""
        offsets, sizes = tuple(int(o) for o in offsets), tuple(int(s) for s in sizes)
        if not offsets and not sizes:
            return cls.full(shape)
        if len(offsets) != len(shape) or len(sizes) != len(shape):
            raise ValueError(
                f"region has {len(offsets)} offsets and {len(sizes)} sizes for a tensor of {len(shape)} dims"
            )
        for dim, (o, s, n) in enumerate(zip(offsets, sizes, shape, strict=True)):
            if o < 0 or s < 0 or o + s > n:
                raise ValueError(f"region [{o}, {o + s}) is outside dim {dim} of size {n}")
        return cls(offsets, sizes)

    @property
    def numel(self) -> int:
        return math.prod(self.sizes)

    def slices(self) -> tuple[slice, ...]:
        return tuple(slice(o, o + s) for o, s in zip(self.offsets, self.sizes, strict=True))

    def overlaps(self, other: Region) -> bool:
        return (
            all(
                a < b + sb and b < a + sa
                for a, sa, b, sb in zip(self.offsets, self.sizes, other.offsets, other.sizes, strict=True)
            )
            and self.numel > 0
            and other.numel > 0
        )


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
