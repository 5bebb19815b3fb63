"""Which region of each global tensor this rank holds, and which of those it pushes.

A plain tensor is the whole region. A DTensor (FSDP2 ``fully_shard``, tensor parallel, or both on
a 2-D mesh) covers ``compute_local_shape_and_global_offset`` of its global shape. Regions held
identically by several ranks (replicated parameters, buffers) are pushed by the lowest such rank
only, so an island's pushes tile every tensor exactly once; every rank still pulls all regions it
holds. Names are canonical (:mod:`atoll.names`): a compiled or checkpoint-wrapped model has the
names of the plain one.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import torch
import torch.distributed as dist

from atoll.names import canonical_name
from atoll.protos.vocabulary import TensorKind


@dataclass(frozen=True)
class LocalShard:
    name: str
    tensor: torch.Tensor
    """The parameter (or buffer) itself; :meth:`local` is this rank's part of it."""
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    owned: bool
    """True when this rank pushes the region (lowest rank holding it)."""
    kind: TensorKind = TensorKind.PARAMETER

    def local(self) -> torch.Tensor:
        """This rank's part of the tensor (a view: writing it updates the parameter)."""
        t = self.tensor
        return t.to_local() if _is_dtensor(t) else t

    @property
    def param(self) -> torch.Tensor:
        return self.tensor

    @property
    def key(self) -> tuple[str, tuple[int, ...], tuple[int, ...]]:
        return (self.name, self.offsets, self.sizes)

    @property
    def is_full(self) -> bool:
        return tuple(self.sizes) == tuple(self.tensor.shape) and not any(self.offsets)


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


def synced_tensors(model: torch.nn.Module, *, buffers: bool = True) -> list[tuple[str, torch.Tensor, str]]:
    """(canonical name, tensor, kind) of what DiLoCo syncs: every parameter, and with ``buffers`` every
    floating-point buffer (BatchNorm running statistics; integer counters stay local)."""
    out = [(canonical_name(n), p, TensorKind.PARAMETER) for n, p in model.named_parameters()]
    if buffers:
        out += [(canonical_name(n), b, TensorKind.BUFFER) for n, b in model.named_buffers() if b.is_floating_point()]
    seen: dict[str, int] = {}
    for name, _, _ in out:
        seen[name] = seen.get(name, 0) + 1
    twice = sorted(n for n, k in seen.items() if k > 1)
    if twice:
        raise ValueError(f"tensors {twice[:5]} have the same name once wrapper prefixes are removed")
    return out


def tied_aliases(model: torch.nn.Module) -> dict[str, tuple[str, ...]]:
    """Tied weights: for each parameter registered under several names (GPT-2's lm_head.weight is
    transformer.wte.weight), its other canonical names; synced once under the first."""
    names: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(canonical_name(name))
    return {first: tuple(dict.fromkeys(n for n in rest if n != first)) for first, *rest in names.values() if rest}


def model_card(model: torch.nn.Module, given: dict | None) -> str:
    """What the model is, as JSON, for the run to keep and an export to carry: ``given`` (the
    ``model_card`` option), else a Hugging Face model's own config (``model.config.to_dict()``, with
    its class in ``architectures``: ``atoll export --hf-dir`` writes it as config.json), else nothing."""
    if given is not None:
        return json.dumps(given, sort_keys=True)
    config = getattr(model, "config", None)
    if config is not None and callable(getattr(config, "to_dict", None)) and getattr(config, "model_type", None):
        card = {**config.to_dict(), "architectures": [type(model).__name__]}
        return json.dumps({"format": "hf", "config": card}, sort_keys=True, default=str)
    return ""


def local_shards(model: torch.nn.Module, group=None, *, buffers: bool = True) -> list[LocalShard]:
    """This rank's shards of ``model``'s synced tensors; collective over ``group`` when distributed."""
    named = synced_tensors(model, buffers=buffers)
    regions = [(name, *_region(t)) for name, t, _ in named]
    if dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1:
        everyone: list = [None] * dist.get_world_size(group)
        dist.all_gather_object(everyone, regions, group=group)
        rank = dist.get_rank(group)
        held_below = {r for lower in everyone[:rank] for r in lower}
    else:
        held_below = set()
    return [
        LocalShard(name, t, offsets, sizes, (name, offsets, sizes) not in held_below, kind)
        for (name, t, kind), (_, offsets, sizes) in zip(named, regions, strict=True)
    ]
