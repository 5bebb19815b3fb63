"""The run's owners as a snapshot, and a snapshot checked against the run a restart was given."""

from __future__ import annotations

import logging
from pathlib import Path

from atoll.coordinator.config import ConfigMismatch, RunConfig, reconcile
from atoll.coordinator.disk import snapshots
from atoll.coordinator.run.options import PlacementOptions
from atoll.coordinator.run.owners import Owners
from atoll.coordinator.state.record import RoundRecord

log = logging.getLogger("atoll.coordinator")


def snapshot(
    owners: Owners, placement: PlacementOptions, params, round_: int, history: list[RoundRecord]
) -> snapshots.Snapshot:
    """θ ``params`` of ``round_`` with the run's optimizer state, membership and ``history``, for the
    shard of ``placement``."""
    members, model = owners.membership.to_json(), owners.model
    return snapshots.Snapshot(
        owners.config(),
        round_,
        params,
        model.state_tensors(),
        members["islands"],
        [h.to_json() for h in history],
        members["departed"],
        tuple(sorted(model.buffers)),
        placement.shard,
        placement.partition,
        model.layout_digest or "",
        model.aliases,
        model_card=model.card,
    )


def load(
    state_dir: Path,
    where: str | None,
    requested: RunConfig,
    given: frozenset[str] | None,
    placement: PlacementOptions,
    name: str = "",
    *,
    snap: snapshots.Snapshot | None = None,
) -> tuple[snapshots.Snapshot, RunConfig] | None:
    """The newest verified snapshot in ``state_dir`` (the working copy of the store at ``where``, if any) with the log
    after it, and the run's config reconciled with the ``requested`` one (the ``given`` operational
    fields win, each change said in a line prefixed by ``name``; None: all were given; a mismatch of
    the run's math or of the shard is a ConfigMismatch); None when the dir holds none. ``snap``: that
    state, loaded and verified already (a standby's), checked against the run as a loaded one is."""
    snap = snap if snap is not None else snapshots.load(state_dir, where=where)
    if snap is None:
        return None
    shard, partition = placement.shard, placement.partition
    if (snap.shard, snap.partition) != (shard, partition):
        raise ConfigMismatch(
            f"the state dir belongs to shard {snap.shard[0]}/{snap.shard[1]} ({snap.partition}), not "
            f"{shard[0]}/{shard[1]} ({partition})"
        )
    given = frozenset(RunConfig.__dataclass_fields__) if given is None else given
    config, changes = reconcile(snap.config, requested, given)
    for line in [*(f"{c} (from the command line)" for c in changes), *snap.notes]:
        log.warning("%srestored run %s: %s", name, config.run_id, line)
    return snap, config
