"""Atomic per-round persistence of the coordinator's state.

One safetensors file holds θ, the outer optimizer's buffers, the downlink error feedback and
(as metadata) the round, run config, membership and history. It is written to a temporary
file, fsynced, renamed over ``state.safetensors`` and the directory fsynced: a crash at any
moment leaves either the previous round's file or the new one, never a mix.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from atoll.coordinator.config import RunConfig

STATE_FILE = "state.safetensors"
FORMAT = "atoll-state-1"


@dataclass
class Snapshot:
    config: RunConfig
    round: int
    """The open round: rounds ``0 .. round-1`` are complete and θ is θ_round."""
    params: dict[str, torch.Tensor]
    extra: dict[str, torch.Tensor] = field(default_factory=dict)
    """Optimizer and error-feedback tensors, by prefixed name."""
    islands: dict[str, dict] = field(default_factory=dict)
    history: list[dict] = field(default_factory=list)


def save(state_dir: Path, snap: Snapshot) -> Path:
    state_dir = Path(state_dir)
    state_dir.mkdir(parents=True, exist_ok=True)
    tensors = {f"param/{k}": v.contiguous() for k, v in snap.params.items()}
    tensors.update({k: v.contiguous() for k, v in snap.extra.items()})
    metadata = {
        "format": FORMAT,
        "round": str(snap.round),
        "config": snap.config.to_json(),
        "islands": json.dumps(snap.islands, sort_keys=True),
        "history": json.dumps(snap.history),
    }
    final = state_dir / STATE_FILE
    tmp = state_dir / f".{STATE_FILE}.tmp"
    save_file(tensors, str(tmp), metadata=metadata)
    fd = os.open(tmp, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, final)
    dfd = os.open(state_dir, os.O_RDONLY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)
    return final


def load(state_dir: Path) -> Snapshot | None:
    """The last persisted snapshot, or None when the directory holds none."""
    path = Path(state_dir) / STATE_FILE
    if not path.exists():
        return None
    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata() or {}
        if meta.get("format") != FORMAT:
            raise ValueError(f"{path}: not an atoll state file (format {meta.get('format')!r})")
        params, extra = {}, {}
        for key in f.keys():  # noqa: SIM118 - safe_open is not iterable
            if key.startswith("param/"):
                params[key[len("param/") :]] = f.get_tensor(key)
            else:
                extra[key] = f.get_tensor(key)
    return Snapshot(
        config=RunConfig.from_json(meta["config"]),
        round=int(meta["round"]),
        params=params,
        extra=extra,
        islands=json.loads(meta["islands"]),
        history=json.loads(meta["history"]),
    )
