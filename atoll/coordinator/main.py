"""``atoll coordinator``: run the daemon until SIGINT/SIGTERM."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
from pathlib import Path

from atoll.coordinator.config import RunConfig
from atoll.coordinator.service import CoordinatorServer

log = logging.getLogger("atoll.coordinator")


def write_port_file(path: Path, port: int) -> None:
    """Write the bound port atomically, so a reader never sees a partial file."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(f"{port}\n")
    os.replace(tmp, path)


async def serve(
    config: RunConfig,
    state_dir: Path,
    *,
    host: str,
    port: int,
    port_file: Path | None,
    admin: dict | None = None,
    security: dict | None = None,
) -> None:
    """``security``: ``{"tls": TlsConfig | None, "tokens": IslandTokens | None}``."""
    admin = admin or {}
    server = CoordinatorServer(
        config,
        state_dir,
        host=host,
        port=port,
        admin_host=admin.get("host", "127.0.0.1"),
        admin_port=admin.get("port"),
        admin_token=admin.get("token"),
        **(security or {}),
    )
    await server.start()
    print(f"atoll coordinator listening on {server.address}", flush=True)
    if server.admin is not None:
        print(f"atoll admin HTTP on {server.admin.address}", flush=True)
        if admin.get("port_file") is not None:
            write_port_file(admin["port_file"], server.admin.port)
    if port_file is not None:
        write_port_file(port_file, server.port)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        log.info("shutting down")
        await server.stop(grace=2.0)


def main(config: RunConfig, state_dir: Path, *, host: str, port: int, port_file: Path | None, **kwargs) -> int:
    asyncio.run(serve(config, state_dir, host=host, port=port, port_file=port_file, **kwargs))
    return 0
