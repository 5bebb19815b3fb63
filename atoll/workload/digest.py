"""θ's digest: equal digests mean bitwise equal parameters (an island reports it per round with
``--digest``; tests compare islands, snapshots and merged shards with it)."""

from __future__ import annotations

import hashlib

import torch

from atoll.workload.parallel import full_tensor


def param_digest(params: dict[str, torch.Tensor]) -> str:
    """sha256 over the names and bytes of the tensors: equal digests = bitwise equal θ."""
    h = hashlib.sha256()
    for name in sorted(params):
        h.update(name.encode())
        # copy=True: .numpy() pins a storage as non-resizable, which FSDP2's own buffers must not be.
        h.update(params[name].detach().to("cpu", torch.float32, copy=True).contiguous().numpy().tobytes())
    return h.hexdigest()


def model_digest(model: torch.nn.Module) -> str:
    """Digest of the whole θ, gathered from the shards (collective on a multi-rank island)."""
    with torch.no_grad():
        return param_digest({n: full_tensor(p) for n, p in model.named_parameters()})
