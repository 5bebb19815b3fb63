"""``atoll coordinator``: run the daemon until SIGINT/SIGTERM, or until a background task fails."""

from __future__ import annotations

import asyncio
import gc
import logging
import signal
from pathlib import Path

from atoll.compression import get_codec
from atoll.coordinator.config import RunConfig
from atoll.coordinator.transport.corelog import CoreLog
from atoll.coordinator.transport.server import CoordinatorServer
from atoll.files import write_atomic
from atoll.memory import tune_for_bulk_buffers
from atoll.objects import ObjectStore, is_url

log = logging.getLogger("atoll.coordinator")


def write_port_file(path: Path, ports: int | list[int]) -> None:
    """Write the bound port(s) atomically, so a reader never sees a partial file.

    One port, or (``--fragments``) the fragments' ports in order, comma-separated."""
    text = ",".join(map(str, ports if isinstance(ports, list) else [ports])) + "\n"
    write_atomic(path, [text.encode()], durable=False)


def where_state_lives(state_dir, work_dir: Path | None = None) -> tuple[Path, ObjectStore | None]:
    """(the local state dir, the object store) for ``--state-dir``: a path (no store), or an
    ``s3://bucket/prefix`` URL whose working copy is ``work_dir`` (default: under the temp dir)."""
    if not is_url(state_dir):
        return Path(state_dir), None
    store = ObjectStore.from_url(state_dir)
    return Path(work_dir or store.default_work_dir("state")), store


async def serve(
    config: RunConfig,
    state_dir: Path | str,
    *,
    host: str,
    port: int,
    port_file: Path | None,
    admin: dict | None = None,
    security: dict | None = None,
    fragments: int = 0,
    options: dict | None = None,
    exit_when_complete: bool = False,
    work_dir: Path | None = None,
) -> int:
    """``security``: ``{"tls": TlsConfig | None, "tokens": IslandTokens | None, "shard": (i, n),
    "partition": "hash" | "layers"}``. ``fragments`` P > 0: serve all P fragments of a streaming run
    (shards i/P, partition "layers") from this process, each on its own port with its own state
    under ``state_dir/fragment-i``; ``port`` is then the first fragment's (0: any free ports).
    ``options``: further :class:`CoordinatorServer` keywords (keep_snapshots, max_inflight_bytes,
    given, ...). ``exit_when_complete``: stop by itself once the run is complete and every live island
    holds the final θ (for batch schedulers). ``state_dir`` ``s3://bucket/prefix``: the state lives in
    that object store (:mod:`atoll.coordinator.disk.mirror`), ``work_dir`` is its local working copy;
    losing the store's lease stops the daemon (exit code 1). Returns the exit code: 0 after a signal
    or a complete run, 1 when a background task failed."""
    admin = admin or {}
    if get_codec(config.codec).drops_values and not config.error_feedback:
        log.warning(
            "codec %s sends some values of each pseudo-gradient and drops the rest: without --error-feedback "
            "the islands lose what it dropped every round (benchmarks/RESULTS.md: add --error-feedback)",
            config.codec,
        )
    state_dir, store = where_state_lives(state_dir, work_dir)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    lost: list[str] = []

    def on_lost(why: str) -> None:
        lost.append(why)
        loop.call_soon_threadsafe(stop.set)

    security = dict(security or {})
    if fragments > 0:
        if security.get("shard", (0, 1)) != (0, 1):
            raise ValueError("--fragments runs every shard of the run itself; drop --shard")
        security.pop("shard", None)
        security["partition"] = "layers"
        placements = [
            {
                "shard": (i, fragments),
                "state_dir": state_dir / f"fragment-{i}",
                "store": store.child(f"fragment-{i}") if store is not None else None,
                "port": port + i if port else 0,
                "name": f"fragment {i}/{fragments}: ",
            }
            for i in range(fragments)
        ]
    else:
        placements = [{"state_dir": state_dir, "store": store, "port": port}]
    servers = []
    for i, place in enumerate(placements):
        kwargs = {**security, **(options or {})}
        if "shard" in place:
            kwargs["shard"] = place["shard"]
            kwargs["name"] = place["name"]
            if kwargs.get("bulk_port"):  # a fixed bulk port: one each, like --port
                kwargs["bulk_port"] += i
        servers.append(
            CoordinatorServer(
                config,
                place["state_dir"],
                host=host,
                port=place["port"],
                admin_host=admin.get("host", "127.0.0.1"),
                admin_port=admin.get("port") if i == 0 else None,  # the admin server shows fragment 0
                admin_token=admin.get("token"),
                store=place["store"],
                on_lost=on_lost if place["store"] is not None else None,
                **kwargs,
            )
        )
    core_log = CoreLog() if security.get("tls") is not None else None  # its handshake lines, in our words
    try:
        for server in servers:
            await server.start()
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
            if admin.get("port_file") is not None:
                write_port_file(admin["port_file"], lead.admin.port)
        if port_file is not None:
            write_port_file(port_file, [server.port for server in servers])
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        stopping = asyncio.ensure_future(stop.wait())
        watcher = asyncio.ensure_future(_stop_when_finished(servers, stop)) if exit_when_complete else None
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


def main(config: RunConfig, state_dir: Path | str, *, host: str, port: int, port_file: Path | None, **kwargs) -> int:
    tune_for_bulk_buffers(huge_pages=False)  # the daemon's own process: payload buffers on the heap (atoll.memory)
    return asyncio.run(serve(config, state_dir, host=host, port=port, port_file=port_file, **kwargs))
