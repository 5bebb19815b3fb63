"""``atoll coordinator``: run the daemon until SIGINT/SIGTERM, or until a background task fails."""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import logging
import signal
import threading
from collections.abc import Callable
from pathlib import Path

import torch

from atoll.compression import get_codec
from atoll.coordinator import standby
from atoll.coordinator.disk.store import LocalState, ObjectState, StateStore
from atoll.coordinator.options import CoordinatorOptions
from atoll.coordinator.transport.corelog import CoreLog
from atoll.coordinator.transport.server import CoordinatorServer
from atoll.errors import BadInput
from atoll.files import write_atomic
from atoll.memory import tune_for_bulk_buffers
from atoll.objects import ObjectStore, is_url

log = logging.getLogger("atoll.coordinator")


def write_port_file(path: Path, ports: int | list[int]) -> None:
    """Write the bound port(s) atomically, so a reader never sees a partial file.

    One port, or (``--fragments``) the fragments' ports in order, comma-separated."""
    text = ",".join(map(str, ports if isinstance(ports, list) else [ports])) + "\n"
    write_atomic(path, [text.encode()], durable=False)


def where_state_lives(
    state_dir,
    work_dir: Path | None = None,
    *,
    lease_seconds: float = 15.0,
    on_lost: Callable[[str], None] | None = None,
) -> tuple[Path, StateStore]:
    """(the local state dir, where the state is kept) for ``--state-dir``: a path (the dir itself), or
    an ``s3://bucket/prefix`` URL whose working copy is ``work_dir`` (default: under the temp dir), held
    under a lease of ``lease_seconds``; ``on_lost(why)`` when the lease is lost. Built once, here."""
    if not is_url(state_dir):
        return Path(state_dir), LocalState()
    store = ObjectStore.from_url(state_dir)
    kept = ObjectState(store, lease_seconds=lease_seconds, on_lost=on_lost)
    return Path(work_dir or store.default_work_dir("state")), kept


async def serve(options: CoordinatorOptions) -> int:
    """Serve the run of ``options`` until a signal, or until a background task fails. With
    ``placement.fragments`` P > 0: all P fragments of a streaming run (shards i/P, partition
    "layers") from this process, each on its own port with its own state under
    ``state_dir/fragment-i`` (:meth:`CoordinatorOptions.fragment`). ``exit_when_complete``: stop by
    itself once the run is complete and every live island holds the final θ (for batch schedulers).
    A ``state_dir`` ``s3://bucket/prefix``: the state lives in that object store
    (:mod:`atoll.coordinator.disk.mirror`), ``work_dir`` is its local working copy; losing the store's
    lease stops the daemon (exit code 1). Returns the exit code: 0 after a signal or a complete run,
    1 when a background task failed."""
    config = options.run
    if get_codec(config.codec).drops_values and not config.error_feedback:
        log.warning(
            "codec %s sends some values of each pseudo-gradient and drops the rest: without --error-feedback "
            "the islands lose what it dropped every round (benchmarks/RESULTS.md: add --error-feedback)",
            config.codec,
        )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    lost: list[str] = []

    def on_lost(why: str) -> None:
        lost.append(why)
        loop.call_soon_threadsafe(stop.set)

    if options.storage.standby:
        standby.refuse_unless_followable(options)
    if options.storage.exact_failover and not is_url(options.state_dir):
        raise BadInput(
            f"--exact-failover is for a run a standby follows in an object store (--state-dir s3://...), "
            f"not the local dir {options.state_dir}"
        )
    state_dir, store = where_state_lives(
        options.state_dir, options.work_dir, lease_seconds=options.storage.lease_seconds, on_lost=on_lost
    )
    preloaded = None
    if options.storage.standby:
        quit_following = threading.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, quit_following.set)
        print(f"atoll coordinator: standby for {options.state_dir}", flush=True)
        preloaded = await asyncio.to_thread(standby.follow, options, state_dir, store, quit_following)
        if preloaded is None:
            return 0

    fragments = options.placement.fragments
    if fragments > 0:
        places = [
            (
                options.fragment(i, state_dir / f"fragment-{i}"),
                store.child(f"fragment-{i}"),
                f"fragment {i}/{fragments}: ",
            )
            for i in range(fragments)
        ]
    else:
        places = [(dataclasses.replace(options, state_dir=state_dir), store, "")]
    servers = [
        CoordinatorServer(
            config,
            place.state_dir,
            network=place.network,
            admin=place.admin,
            security=place.security,
            placement=place.placement,
            storage=place.storage,
            limits=place.limits,
            given=place.given,
            name=name,
            store=place_store,
        )
        for place, place_store, name in places
    ]
    admin = options.admin
    core_log = CoreLog() if options.security.tls is not None else None  # its handshake lines, in our words
    try:
        for server in servers:  # (a standby follows no fragments: one server)
            await server.start(preloaded)
        if core_log is not None:
            core_log.start()
        # Everything allocated so far (torch, grpc, the restored state) lives as long as the
        # daemon: move it out of the collector's reach so a full collection triggered by the
        # per-chunk garbage of a push does not walk it each time (perf: ~12% of ingest CPU).
        gc.freeze()
        addresses = ",".join(server.address for server in servers)
        print(f"atoll coordinator listening on {addresses}", flush=True)
        lead = servers[0]
        if lead.admin is not None:
            print(f"atoll admin HTTP on {lead.admin.address}", flush=True)
            if admin.port_file is not None:
                write_port_file(admin.port_file, lead.admin.port)
        if options.network.port_file is not None:
            write_port_file(options.network.port_file, [server.port for server in servers])
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        stopping = asyncio.ensure_future(stop.wait())
        watcher = asyncio.ensure_future(_stop_when_finished(servers, stop)) if options.exit_when_complete else None
        await asyncio.wait({stopping, *(s.failed for s in servers)}, return_when=asyncio.FIRST_COMPLETED)
        stopping.cancel()
        if watcher is not None:
            watcher.cancel()
        return 1 if lost or any(s.failed.done() for s in servers) else 0
    finally:
        log.info("shutting down")
        for server in servers:
            if server.port is not None:
                await server.stop(grace=2.0)
        if core_log is not None:
            core_log.stop()


async def _stop_when_finished(servers: list[CoordinatorServer], stop: asyncio.Event) -> None:
    while not all(s.state.finished() for s in servers):
        await asyncio.sleep(0.5)
    log.info("the run is complete and every island holds its final θ: the coordinator exits")
    stop.set()


def main(options: CoordinatorOptions) -> int:
    tune_for_bulk_buffers(huge_pages=False)  # the daemon's own process: payload buffers on the heap (atoll.memory)
    if options.limits.threads:
        torch.set_num_threads(options.limits.threads)
    return asyncio.run(serve(options))
