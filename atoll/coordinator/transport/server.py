"""The coordinator daemon as an object: ``await start()``, ``address``, ``await stop(grace)``."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import errno
import logging
import socket
import warnings
from collections.abc import Iterable
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from atoll.coordinator.config import RunConfig
from atoll.coordinator.disk.store import ObjectState, StateStore
from atoll.coordinator.run.decider import run_decider
from atoll.coordinator.run.options import LimitsOptions, PlacementOptions, StorageOptions
from atoll.coordinator.run.run_state import RunState
from atoll.coordinator.run.upstream import Upstream
from atoll.coordinator.state.outer import NonFiniteTheta
from atoll.coordinator.transport.bulk_port import BulkServer
from atoll.coordinator.transport.counters import Counters
from atoll.coordinator.transport.options import AdminOptions, NetworkOptions, SecurityOptions
from atoll.coordinator.transport.security import TokenInterceptor
from atoll.coordinator.transport.service import CoordinatorServicer, add_servicer
from atoll.errors import PortInUse
from atoll.protos.rpc import SERVER_OPTIONS, SERVICE_NAME

log = logging.getLogger("atoll.coordinator")


def ensure_free(host: str, port: int, what: str) -> None:
    """PortInUse naming ``what`` and the port when something listens there already: one bind of it
    without SO_REUSEPORT (which a second coordinator's gRPC would otherwise set, and share the port
    with the first, islands dividing between the two)."""
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((host, port))
    except OSError as err:
        if err.errno == errno.EADDRINUSE:
            raise PortInUse(f"{what} {port} on {host} is in use (another coordinator serves it?)") from None
        raise PortInUse(f"{what} {port} on {host} cannot be bound: {err.strerror or err}") from None


def ensure_ports_free(host: str, port: int, bulk_port: int | None, admin: AdminOptions) -> None:
    """:func:`ensure_free` for each fixed port a coordinator is told to bind (0 or None: none)."""
    fixed = (("--port", host, port), ("--bulk-port", host, bulk_port), ("--admin-port", admin.host, admin.port))
    for what, on, number in fixed:
        if number:
            ensure_free(on, number, what)


FLAT = {
    "host": ("network", "host"),
    "port": ("network", "port"),
    "bulk_port": ("network", "bulk_port"),
    "stream_idle_seconds": ("network", "stream_idle_seconds"),
    "admin_host": ("admin", "host"),
    "admin_port": ("admin", "port"),
    "admin_token": ("admin", "token"),
    "tls": ("security", "tls"),
    "tokens": ("security", "tokens"),
    "shard": ("placement", "shard"),
    "partition": ("placement", "partition"),
    "keep_snapshots": ("storage", "keep_snapshots"),
    "snapshot_every": ("storage", "snapshot_every"),
    "store_lease_seconds": ("storage", "lease_seconds"),
    "max_inflight_bytes": ("limits", "max_inflight_bytes"),
    "max_pull_bytes": ("limits", "max_pull_bytes"),
}
"""CoordinatorServer's keywords before its options were typed: (the options object, its field)."""


def typed_from_flat(flat: dict, network, admin, security, placement, storage, limits, store):
    """The typed options of the flat keywords ``flat`` (an ``ObjectStore`` as ``store``, with
    ``on_lost``), each given over what the typed ones say; FutureWarning naming the typed form, and a
    TypeError for a keyword that never was."""
    from atoll.objects import ObjectStore

    on_lost = flat.pop("on_lost", None)
    unknown = sorted(set(flat) - set(FLAT))
    if unknown:
        raise TypeError(f"CoordinatorServer() got unexpected keyword arguments: {', '.join(unknown)}")
    warnings.warn(
        f"CoordinatorServer({', '.join(sorted(flat))}=...) is deprecated and goes in the next release: pass "
        "typed options (network=NetworkOptions(...), admin=AdminOptions(...), ...: atoll.coordinator.options)",
        FutureWarning,
        stacklevel=3,
    )
    given = {
        "network": network or NetworkOptions(),
        "admin": admin or AdminOptions(),
        "security": security or SecurityOptions(),
        "placement": placement or PlacementOptions(),
        "storage": storage or StorageOptions(),
        "limits": limits or LimitsOptions(),
    }
    for key, value in flat.items():
        which, name = FLAT[key]
        given[which] = dataclasses.replace(given[which], **{name: value})
    if isinstance(store, ObjectStore):
        store = ObjectState(store, lease_seconds=given["storage"].lease_seconds, on_lost=on_lost)
    return (*given.values(), store)


class CoordinatorServer:
    def __init__(
        self,
        config: RunConfig,
        state_dir: Path,
        *,
        network: NetworkOptions | None = None,
        admin: AdminOptions | None = None,
        security: SecurityOptions | None = None,
        placement: PlacementOptions | None = None,
        storage: StorageOptions | None = None,
        limits: LimitsOptions | None = None,
        given: Iterable[str] | None = None,
        name: str = "",
        store: StateStore | None = None,
        upstream: Upstream | None = None,
        **flat,
    ) -> None:
        """The run ``config`` served from ``state_dir`` (a local dir: an object store's working copy
        when ``store`` is given), with typed options per concern (:mod:`atoll.coordinator.options`
        builds them from the command line). ``admin.port``: serve the admin HTTP endpoints there (0
        picks a port; None: no admin server). ``network.bulk_port``: serve pushes and pulls as TCP
        streams there too (0 picks a port; None: no bulk port), on ``network.host``; with TLS, over TLS
        with the same certificates (:mod:`atoll.protos.bulk`). ``given``: the RunConfig fields the
        operator set explicitly (None: all of them); on an existing state dir those of the run's math
        must match it, and its operational ones take them. ``name``: prefix of this server's log lines
        (a fragment's). ``store``: where the state is kept (:mod:`atoll.coordinator.disk.store`;
        default: ``state_dir`` itself). ``upstream``: this server is a relay's, and that is the
        coordinator above it (:mod:`atoll.coordinator.run.upstream`)."""
        if flat:  # the keywords of the release before the typed options: one more release, with a warning
            typed = typed_from_flat(flat, network, admin, security, placement, storage, limits, store)
            network, admin, security, placement, storage, limits, store = typed
        network, admin, security = network or NetworkOptions(), admin or AdminOptions(), security or SecurityOptions()
        self.config = config
        self.admin_options = admin
        self.tls = security.tls
        self.tokens = security.tokens
        self.state_options = dict(
            placement=placement,
            storage=storage,
            limits=limits,
            given=None if given is None else frozenset(given),
            name=name,
            store=store,
        )
        self.stream_idle_seconds = network.stream_idle_seconds
        self.requested_bulk_port = network.bulk_port
        self.bulk: BulkServer | None = None
        self.admin = None
        self.state_dir = Path(state_dir)
        self.host = network.host
        self.requested_port = network.port
        self.port: int | None = None
        self.name = name
        self.state: RunState | None = None
        self.counters = Counters()
        self.failed: asyncio.Future | None = None
        """Resolves with the exception that ended a background task (the daemon then exits non-zero)."""
        self._server: grpc.aio.Server | None = None
        self.servicer: CoordinatorServicer | None = None
        self._decider: asyncio.Task | None = None
        self.upstream = upstream

    @property
    def address(self) -> str:
        if self.port is None:
            raise RuntimeError("server not started")
        return f"{self.host}:{self.port}"

    async def start(self, preloaded=None) -> None:
        """Restore the run (refusing a state dir that does not verify), then serve. PortInUse (one
        line) when a port it was told to bind is served already, before anything listens.
        ``preloaded``: the run's state, verified and in memory already (a standby's takeover)."""
        admin_host, admin_port, admin_token = self.admin_options.host, self.admin_options.port, self.admin_options.token
        ensure_ports_free(self.host, self.requested_port, self.requested_bulk_port, self.admin_options)
        self.state = RunState(self.config, self.state_dir, **self.state_options)
        self.state.upstream = self.upstream
        self.state.restore(preloaded)
        if admin_port is not None:  # built first: a bad admin config fails before anything listens
            from atoll.coordinator.transport.admin import AdminServer

            self.admin = AdminServer(self, host=admin_host, port=admin_port, token=admin_token)
        interceptors = [TokenInterceptor(self.tokens)] if self.tokens else []
        self._server = grpc.aio.server(options=SERVER_OPTIONS, interceptors=interceptors)
        servicer = self.servicer = CoordinatorServicer(self.state, self.tokens, self.counters, self.stream_idle_seconds)
        add_servicer(servicer, self._server)
        health_servicer = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(health_servicer, self._server)
        bind = f"{self.host}:{self.requested_port}"
        try:
            if self.tls is not None:
                self.port = self._server.add_secure_port(bind, self.tls.server_credentials())
            else:
                self.port = self._server.add_insecure_port(bind)
        except RuntimeError:  # taken since the check above
            self.port = 0
        if self.port == 0:
            raise PortInUse(f"--port {self.requested_port} on {self.host} cannot be bound (in use by another process?)")
        if self.requested_bulk_port is not None:
            self.bulk = BulkServer(
                servicer,
                host=self.host,
                port=self.requested_bulk_port,
                tokens=self.tokens,
                idle_seconds=self.stream_idle_seconds,
                tls=self.tls.ssl_context() if self.tls is not None else None,
            )
            await self.bulk.start()
            servicer.bulk_port = self.bulk.port
            servicer.bulk_keep_seconds = int(self.bulk.keep_seconds)
        await self._server.start()
        for name in ("", SERVICE_NAME):
            await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
        self.failed = asyncio.get_running_loop().create_future()
        self._decider = asyncio.create_task(run_decider(self.state), name="atoll-decider")
        self._decider.add_done_callback(self._task_ended)
        if self.admin is not None:
            await self.admin.start()
            log.info("admin HTTP on %s", self.admin.address)
        log.info(
            "coordinator for run %s serving on %s%s (state in %s)",
            self.state.config.run_id,
            self.address,
            f", bulk port {self.bulk.port}" if self.bulk is not None else "",
            self.state_dir,
        )

    def _task_ended(self, task: asyncio.Task) -> None:
        if task.cancelled() or self.failed is None or self.failed.done():
            return
        err = task.exception()
        if err is None:
            err = RuntimeError(f"background task {task.get_name()} returned")
        if isinstance(err, NonFiniteTheta):  # one line: it names the tensor, the state on disk is sound
            log.error("%s%s; the coordinator stops (restarted, it resumes from its last round)", self.name, err)
        else:
            log.error("background task %s died; the coordinator stops", task.get_name(), exc_info=err)
        self.failed.set_exception(err)

    async def stop(self, grace: float | None = 1.0) -> None:
        if self.admin is not None:
            await self.admin.stop()
            self.admin = None
        if self._decider is not None:
            self._decider.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._decider
            self._decider = None
        if self.failed is not None and self.failed.done() and not self.failed.cancelled():
            self.failed.exception()  # retrieved: no "exception was never retrieved" at exit
        if self.bulk is not None:
            await self.bulk.stop()
            self.bulk = None
        if self.servicer is not None:
            self.servicer.parked.close()
        if self._server is not None:
            await self._server.stop(grace)
            self._server = None
        if self.state is not None:
            await asyncio.to_thread(self.state.close)
