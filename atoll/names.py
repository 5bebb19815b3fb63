"""Canonical tensor names: the same parameter has the same name on every island, wrapped or not.

torch's own wrappers rename parameters: ``torch.compile`` puts the model under ``_orig_mod.``,
activation checkpointing (``checkpoint_wrapper``) puts a module under
``_checkpoint_wrapped_module.``, FSDP1 under ``_fsdp_wrapped_module.``, DistributedDataParallel and
DataParallel under a leading ``module.``. Islands send, and the coordinator reads, names with these
parts removed, so an island that compiles or checkpoints its model joins a run of plain islands.
"""

from __future__ import annotations

WRAPPER_PARTS = ("_orig_mod", "_checkpoint_wrapped_module", "_fsdp_wrapped_module")
"""Name components added by torch's wrappers anywhere in a module tree."""
LEADING_PARTS = ("module",)
"""Components added at the front (DistributedDataParallel, DataParallel)."""


def canonical_name(name: str) -> str:
    parts = [p for p in name.split(".") if p not in WRAPPER_PARTS]
    while len(parts) > 1 and parts[0] in LEADING_PARTS:
        parts = parts[1:]
    return ".".join(parts)
