"""``atoll relay``: serve a region's islands and forward their rounds to the coordinator above, until
SIGINT/SIGTERM or until a background task fails.

    atoll relay --upstream root.example:7070 --run-id my-run --host 0.0.0.0 --port 7071 --relay-id eu

Islands join the relay as they join a coordinator (``atoll island --coordinator relay:7071``). The
relay takes the run's configuration from its upstream when its first island joins; its own state (the
rounds it forwarded, for its islands' catch-up) lives in a temporary dir removed at exit: a restarted
relay joins afresh and takes θ from its upstream. A relay that could not remove its dir (SIGKILLed, or
its machine lost power: 2.8 GB at 124M after four rounds) leaves it to the next relay started on the
machine, which removes it (:func:`sweep_stale`).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import shutil
import signal
import socket
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from atoll.coordinator import options as flags_of
from atoll.coordinator.config import RunConfig
from atoll.coordinator.disk.lock import LOCK, StateLock
from atoll.coordinator.disk.snapshots import StateError
from atoll.coordinator.main import write_port_file
from atoll.coordinator.policy import grace
from atoll.coordinator.transport.options import AdminOptions, NetworkOptions, SecurityOptions
from atoll.coordinator.transport.server import CoordinatorServer
from atoll.islands import ClientTls, RetryPolicy
from atoll.islands.session import parse_addresses
from atoll.memory import tune_for_bulk_buffers
from atoll.relay.link import RelayUpstream

log = logging.getLogger("atoll.relay")

STATE_PREFIX = "atoll-relay-"
"""The relay's temporary state dir's name begins so (in ``tempfile.gettempdir()``)."""


def sweep_stale(root: Path) -> list[Path]:
    """Remove the state dirs that relays which died left in ``root``; returns them. A dir is stale when
    its ``.lock`` names a writer (the relay took the dir's lock) and nobody holds that lock now: the
    kernel drops it with its process. A dir whose lock is held (a live relay), or that has no ``.lock``
    yet (a relay starting), is left alone, as is anything not named :data:`STATE_PREFIX`."""
    removed = []
    for d in sorted(root.glob(f"{STATE_PREFIX}*")):
        if not d.is_dir() or d.is_symlink() or not (d / LOCK).is_file():
            continue
        try:
            lock = StateLock(d).acquire("removing it")
        except (StateError, OSError):
            continue  # a live relay's, or not ours to take
        try:
            shutil.rmtree(d, ignore_errors=True)
        finally:
            lock.release()
        if not d.exists():
            removed.append(d)
    return removed


@dataclass(frozen=True)
class RelayOptions:
    upstream: str
    run_id: str
    relay_id: str
    network: NetworkOptions
    security: SecurityOptions
    upstream_token: str | None = None
    upstream_tls: ClientTls | None = None
    give_up_seconds: float = 600.0
    quorum: int = 1
    grace_window: str | None = None
    admin: AdminOptions = field(default_factory=AdminOptions)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--upstream", required=True, help="HOST:PORT of the coordinator (or relay) above (required)")
    parser.add_argument("--run-id", required=True, help="the run to serve; the upstream must serve it (required)")
    parser.add_argument("--relay-id", default=None, help="this relay's name in the run (default: relay-HOSTNAME)")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind for islands (default: loopback)")
    parser.add_argument("--port", type=int, default=0, help="port to bind; 0 picks a free one (default: 0)")
    parser.add_argument(
        "--bulk-port", type=int, default=0, help="the bulk port for islands' pushes and pulls; 0 picks one, -1: none"
    )
    parser.add_argument("--port-file", type=Path, default=None, help="write the bound port here once serving")
    parser.add_argument(
        "--quorum",
        type=int,
        default=1,
        help="a round here waits for at least this many of the relay's islands, up to the run's round deadline "
        "(its own: the root's --quorum counts the islands of the whole run; default: 1, every live island)",
    )
    parser.add_argument(
        "--grace-window",
        default=None,
        help="once its quorum is in, how long a round here waits for its missing islands: auto, off or seconds "
        "(default: the run's); 0 forwards whatever has arrived as soon as the relay is free to",
    )
    flags_of.add_admin_arguments(parser.add_argument_group("admin HTTP (the relay's own: its islands, its rounds)"))
    flags_of.add_security_arguments(parser.add_argument_group("islands' side (as a coordinator's)"))
    up = parser.add_argument_group("upstream side (as an island's)")
    up.add_argument("--upstream-token", default=None, help="this relay's bearer token at the upstream")
    up.add_argument("--upstream-ca", default=None, help="PEM CA of the upstream's certificate: connect over TLS")
    up.add_argument("--upstream-cert", default=None, help="PEM certificate of this relay (mutual TLS upstream)")
    up.add_argument("--upstream-key", default=None, help="PEM private key for --upstream-cert")
    up.add_argument(
        "--upstream-server-name", default=None, help="the name in the upstream's certificate, if not its host"
    )
    up.add_argument(
        "--give-up-seconds",
        type=float,
        default=600.0,
        help="how long the relay waits on an unreachable upstream before it gives up (default: 600)",
    )


def from_args(ns: argparse.Namespace) -> RelayOptions:
    """The typed options (ValueError on a bad combination, as the coordinator's flags)."""
    parse_addresses(ns.upstream)  # ValueError when malformed
    if ns.quorum < 1:
        raise ValueError(f"--quorum must be at least 1, got {ns.quorum}")
    if ns.grace_window is not None:
        grace.parse(ns.grace_window)  # ValueError, naming it
    if (ns.upstream_cert is None) != (ns.upstream_key is None) or (ns.upstream_cert and not ns.upstream_ca):
        raise ValueError("--upstream-cert and --upstream-key go together, and need --upstream-ca")
    up_tls = None
    if ns.upstream_ca:
        up_tls = ClientTls(
            ca=ns.upstream_ca, cert=ns.upstream_cert, key=ns.upstream_key, server_name=ns.upstream_server_name
        )
    return RelayOptions(
        upstream=ns.upstream,
        run_id=ns.run_id,
        relay_id=ns.relay_id or f"relay-{socket.gethostname()}",
        network=NetworkOptions(
            host=ns.host, port=ns.port, port_file=ns.port_file, bulk_port=None if ns.bulk_port < 0 else ns.bulk_port
        ),
        security=flags_of.security_from_args(ns),
        upstream_token=ns.upstream_token,
        upstream_tls=up_tls,
        give_up_seconds=ns.give_up_seconds,
        quorum=ns.quorum,
        grace_window=ns.grace_window,
        admin=flags_of.admin_from_args(ns),
    )


class RelayServer:
    """A relay in this process: the run's core serving islands, over :class:`RelayUpstream`."""

    def __init__(self, options: RelayOptions, state_dir: Path) -> None:
        self.options = options
        self.upstream = RelayUpstream(
            options.upstream,
            run_id=options.run_id,
            relay_id=options.relay_id,
            token=options.upstream_token,
            tls=options.upstream_tls,
            retry=RetryPolicy(give_up_seconds=options.give_up_seconds),
            quorum=options.quorum,
            grace_window=options.grace_window,
        )
        placeholder = RunConfig(run_id=options.run_id)  # replaced by the upstream's at the first join
        self.server = CoordinatorServer(
            placeholder,
            state_dir,
            network=options.network,
            security=options.security,
            admin=options.admin,
            upstream=self.upstream,
        )

    async def start(self) -> None:
        await self.server.start()
        self.upstream.state = self.server.state

    @property
    def address(self) -> str:
        return self.server.address

    @property
    def state(self):
        """The run's core serving the relay's islands (``RunState``)."""
        return self.server.state

    async def stop(self, grace: float = 2.0) -> None:
        await asyncio.to_thread(self.upstream.close)
        await self.server.stop(grace=grace)


async def serve(options: RelayOptions) -> int:
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for stale in sweep_stale(Path(tempfile.gettempdir())):
        log.info("removed %s, the state a relay left when it died", stale)
    with tempfile.TemporaryDirectory(prefix=STATE_PREFIX, ignore_cleanup_errors=True) as state_dir:
        relay = RelayServer(options, Path(state_dir))
        await relay.start()
        try:
            print(
                f"atoll relay {options.relay_id} listening on {relay.address} (upstream {options.upstream})", flush=True
            )
            if options.network.port_file is not None:
                write_port_file(options.network.port_file, relay.server.port)
            if relay.server.admin is not None:
                print(f"atoll admin HTTP on {relay.server.admin.address}", flush=True)
                if options.admin.port_file is not None:
                    write_port_file(options.admin.port_file, relay.server.admin.port)
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.add_signal_handler(sig, stop.set)
            stopping = asyncio.ensure_future(stop.wait())
            await asyncio.wait({stopping, relay.server.failed}, return_when=asyncio.FIRST_COMPLETED)
            stopping.cancel()
            return 1 if relay.server.failed.done() else 0
        finally:
            log.info("relay %s shutting down", options.relay_id)
            await relay.stop()


def main(options: RelayOptions) -> int:
    tune_for_bulk_buffers(huge_pages=False)  # a daemon holding pushes, as the coordinator's (atoll.memory)
    return asyncio.run(serve(options))
