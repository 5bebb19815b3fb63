"""What the coordinator's memory holds, by holder, in bytes: for ``/api/status`` ("memory") and the
memory benchmark, which sets it beside the process's RSS in units of fp32 |θ|.

Each buffer is counted once, under the first holder that has it (the last update's payloads are also
the next step's spares; a replaced θ becomes the next round's sum)."""

from __future__ import annotations

import numpy as np
import torch


def _nbytes(x) -> tuple[int, int]:
    """(an address that names the buffer, its bytes) of a tensor, an array or a bytes-like payload."""
    if isinstance(x, torch.Tensor):
        return x.untyped_storage().data_ptr(), x.untyped_storage().nbytes()
    if isinstance(x, np.ndarray):
        base = x if x.base is None else x.base
        return (base.ctypes.data if isinstance(base, np.ndarray) else id(base)), x.nbytes
    view = memoryview(x)
    owner = view.obj if view.obj is not None else x
    if isinstance(owner, np.ndarray):
        return _nbytes(owner)
    return id(owner), view.nbytes


def held_bytes(model, accumulator, downlink) -> dict[str, int]:
    """Bytes held now: θ, the outer optimizer's state (momentum), the round's sum, the downlink's error
    feedback, the last update's payloads (with the next step's spares), the pushes' pooled receive
    buffers and what the push and pull budgets hold reserved."""
    seen: set[int] = set()

    def total(items) -> int:
        n = 0
        for x in items:
            ptr, size = _nbytes(x)
            if ptr and ptr not in seen:
                seen.add(ptr)
                n += size
        return n

    optimizer = model.optimizer.state_tensors().values() if model.optimizer is not None else ()
    latest = (downlink.latest or {}).values()
    pool = accumulator.buffers.free_buffers()
    return {
        "theta": total((model.params or {}).values()),
        "optimizer": total(optimizer),
        "sum": total(accumulator.sum_tensors()),
        "downlink_ef": total(model.downlink_ef.values()),
        "update": total([*latest, *model.spare_payloads()]),
        "push_buffers_pooled": total(pool),
        "push_reserved": accumulator.budget.used,
        "pull_reserved": downlink.budget.used,
    }
