"""The run's owners as a snapshot, and a snapshot checked against the run a restart was given.

``state`` is the :class:`~atoll.coordinator.run.run_state.RunState` (not imported: it imports this).
"""

from __future__ import annotations

import logging

from atoll.coordinator.config import ConfigMismatch, RunConfig, reconcile
from atoll.coordinator.disk import snapshots

log = logging.getLogger("atoll.coordinator")


def snapshot(state, params, round_: int, history: list[dict]) -> snapshots.Snapshot:
    """θ ``params`` of ``round_`` with the run's optimizer state, membership and ``history``."""
    members = state.membership.to_json()
    return snapshots.Snapshot(
        state.config,
        round_,
        params,
        state.model.state_tensors(),
        members["islands"],
        history,
        members["departed"],
        tuple(sorted(state.model.buffers)),
        state.shard,
        state.partition,
        state.model.layout_digest or "",
        state.model.aliases,
        model_card=state.model.card,
    )


def load(state) -> tuple[snapshots.Snapshot, RunConfig] | None:
    """The newest verified snapshot of ``state``'s dir with the log after it, and the run's config
    reconciled with ``state``'s (the command line's operational fields win, each change said; a
    mismatch of the run's math or of the shard is a ConfigMismatch); None when the dir holds none."""
    snap = snapshots.load(state.state_dir, where=state.store.url if state.store is not None else None)
    if snap is None:
        return None
    if (snap.shard, snap.partition) != (state.shard, state.partition):
        raise ConfigMismatch(
            f"the state dir belongs to shard {snap.shard[0]}/{snap.shard[1]} ({snap.partition}), not "
            f"{state.shard[0]}/{state.shard[1]} ({state.partition})"
        )
    given = frozenset(RunConfig.__dataclass_fields__) if state.given is None else state.given
    config, changes = reconcile(snap.config, state.config, given)
    for line in [*(f"{c} (from the command line)" for c in changes), *snap.notes]:
        log.warning("%srestored run %s: %s", state.name, config.run_id, line)
    return snap, config
