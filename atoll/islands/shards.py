"""Which region of each global tensor this rank holds, and which of those it pushes.

A plain tensor is the whole region. A DTensor (FSDP2 ``fully_shard``, tensor parallel, or both on
a 2-D mesh) covers ``compute_local_shape_and_global_offset`` of its global shape. Regions held
identically by several ranks (replicated parameters) are pushed by the lowest such rank only, so
an island's pushes tile every tensor exactly once; every rank still pulls all regions it holds.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class LocalShard:
    name: str
    param: torch.nn.Parameter
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    owned: bool
    """True when this rank pushes the region (lowest rank holding it)."""

    def local(self) -> torch.Tensor:
        """This rank's part of the parameter (a view: writing it updates the parameter)."""
        p = self.param
        return p.to_local() if _is_dtensor(p) else p

    @property
    def key(self) -> tuple[str, tuple[int, ...], tuple[int, ...]]:
        return (self.name, self.offsets, self.sizes)

    @property
    def is_full(self) -> bool:
        return tuple(self.sizes) == tuple(self.param.shape) and not any(self.offsets)


def _is_dtensor(p) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - torch without distributed
        return False
    return isinstance(p, DTensor)


def _region(p) -> tuple[tuple[int, ...], tuple[int, ...]]:
    if not _is_dtensor(p):
        return tuple(0 for _ in p.shape), tuple(p.shape)
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    sizes, offsets = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
    return tuple(int(o) for o in offsets), tuple(int(s) for s in sizes)


def local_shards(model: torch.nn.Module, group=None) -> list[LocalShard]:
    """This rank's shards of ``model``'s parameters; collective over ``group`` when distributed."""
    named = list(model.named_parameters())
    regions = [(name, *_region(p)) for name, p in named]
    if dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1:
        everyone: list = [None] * dist.get_world_size(group)
        dist.all_gather_object(everyone, regions, group=group)
        rank = dist.get_rank(group)
        held_below = {r for lower in everyone[:rank] for r in lower}
    else:
        held_below = set()
    return [
        LocalShard(name, p, offsets, sizes, (name, offsets, sizes) not in held_below)
        for (name, p), (_, offsets, sizes) in zip(named, regions, strict=True)
    ]
