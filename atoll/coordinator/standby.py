"""``atoll coordinator --standby``: a hot standby for a run kept in an object store.

It follows the run another coordinator serves (:class:`~atoll.coordinator.disk.follow.Follower`: the
working copy in step with the store, θ and the optimizer state in memory, every record verified as it
lands) and watches that coordinator's lease on its own clock
(:class:`~atoll.lease.LeaseWatch`). The moment the lease has gone unrenewed for its length, it takes
it with a write conditional on the very lease it watched (of two standbys, one wins; a holder that
renewed meanwhile keeps it), compares its copy with the store once more, and serves the newest round
from memory: no supervisor loop, no wait on the dead holder's wall clock, no download of the state.
Islands given ``primary|standby`` move to it by themselves.

A local ``--state-dir`` cannot be followed from another machine: a standby needs the state in a
store (one line, exit 2), as does ``--fragments``.
"""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path

from atoll.coordinator.disk.follow import Follower
from atoll.coordinator.disk.mirror import Mirror
from atoll.coordinator.disk.snapshots import Snapshot, StateError
from atoll.coordinator.disk.store import ObjectState, StateStore
from atoll.coordinator.disk.wal import LogError
from atoll.coordinator.options import CoordinatorOptions
from atoll.coordinator.transport.server import ensure_ports_free
from atoll.errors import BadInput
from atoll.lease import Lease, LeaseWatch
from atoll.objects import StoreError, is_url

log = logging.getLogger("atoll.coordinator")

POLL_SECONDS = (0.05, 1.0)
"""A standby reads the lease and lists the store every tenth of the lease, within these bounds."""


def refuse_unless_followable(options: CoordinatorOptions) -> None:
    """BadInput (one line, exit 2) for a standby that cannot work: a local state dir, fragments; and
    PortInUse (one line) for a port it is to serve on that is taken already: said now, not found out
    at the takeover."""
    if not is_url(options.state_dir):
        raise BadInput(
            f"--standby follows a run kept in an object store (--state-dir s3://BUCKET/PREFIX), not the local dir "
            f"{options.state_dir}: a standby on another machine cannot follow a local dir; keep the state in a "
            "store for high availability"
        )
    if options.placement.fragments:
        raise BadInput("--standby does not follow a --fragments coordinator's run (one lease per fragment)")
    ensure_ports_free(options.network.host, options.network.port, options.network.bulk_port, options.admin)


def follow(options: CoordinatorOptions, state_dir: Path, store: StateStore, stop: threading.Event) -> Snapshot | None:
    """Follow the run until its holder's lease lapses, take the lease and return the run's state,
    verified, with ``store`` holding the lease and the working copy (:meth:`ObjectState.adopt`);
    None when ``stop`` was set first. Blocking: run it in a thread. BadInput (exit 2) when the store
    holds no run, or another run than ``--run-id``."""
    assert isinstance(store, ObjectState)
    seconds = options.storage.lease_seconds
    run_id = options.run.run_id if options.given is None or "run_id" in options.given else None
    follower = Follower(store.store, state_dir, run_id)
    follower.start()
    watch = LeaseWatch(store.store.within(max(0.5, seconds / 6)))
    poll = min(max(seconds / 10, POLL_SECONDS[0]), POLL_SECONDS[1])
    try:
        lease = None
        while lease is None:
            if stop.is_set():
                return None
            try:
                seen = watch.read()
                if seen.left <= 0:
                    lease = Lease(store.store, seconds, on_lost=store.on_lost).take_over(seen.etag)
                    lapsed = f"the lease of {seen.owner} lapsed" if seen.etag else "no coordinator held it"
                    break
                follower.catch_up()
            except (StoreError, StateError, LogError) as err:  # (a lost race for the lease is a StoreError too)
                log.warning("following %s: %s (tried again)", store.url, err)
                seen = None
            stop.wait(poll if seen is None else min(poll, max(seen.left, 0.01)))
        started = time.monotonic()
        try:
            notes = follower.final()
        except BaseException:
            lease.release()
            raise
        snap = follower.snap
        snap.notes = notes
        store.adopt(Mirror.adopt(store.store, state_dir, lease, snap.config.run_id))
        log.warning(
            "standby: took over run %s in %s at round %d (%s; %d rounds followed; caught up in %.2f s)",
            snap.config.run_id,
            store.url,
            snap.round,
            lapsed,
            follower.rounds_followed,
            time.monotonic() - started,
        )
        return snap
    finally:
        follower.release()
