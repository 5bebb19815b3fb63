"""An island's connection to the coordinator: where it is, who the island is, how to talk to it.

:class:`CoordinatorLink` owns the transport (one client per coordinator shard, with deadlines,
retries and TLS), the island's identity in the run (run id, island id, the process's session id) and
its membership (joining, heartbeats from the join on, leaving). It knows nothing of models or
pseudo-gradients: :class:`~atoll.islands.DiLoCo` is the algorithm and uses a link.

    link = CoordinatorLink("coord.example:7070", run_id="my-run", island_id="site-a")
    with DiLoCo(model, link) as sync:
        ...

The transport is a seam, in atoll's own messages: ``connect(address)`` returns anything shaped like
:class:`Transport` (the real :class:`WireTransport` over a
:class:`~atoll.islands._transport.client.CoordinatorClient` by default; a bare client, the seam's form
before this release, is put behind one); the harness injects faults by wrapping the real transport there.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import uuid
from collections.abc import Callable

import torch.distributed as dist

from atoll.islands._messages import Identity, JoinAnswer
from atoll.islands._terms import IslandTerms
from atoll.islands._transport.addresses import parse_addresses
from atoll.islands._transport.client import ClientTls, CoordinatorClient, RetryPolicy
from atoll.islands._transport.seam import Transport, WireTransport, transport_of
from atoll.islands._transport.session import Session

log = logging.getLogger("atoll.island")


class CoordinatorLink:
    def __init__(
        self,
        coordinator: str,
        *,
        run_id: str = "atoll",
        island_id: str | None = None,
        token: str | None = None,
        tls: ClientTls | None = None,
        retry: RetryPolicy | None = None,
        connect_timeout_seconds: float = 120.0,
        heartbeat_seconds: float = 5.0,
        pull_wait_seconds: float = 10.0,
        connect: Callable[[str], Transport] | None = None,
        bulk_streams: int | None = None,
    ) -> None:
        """``coordinator``: ``host:port``, or its shards (Streaming DiLoCo fragments) comma-separated
        (ValueError at once when malformed). ``island_id``: this island's name in the run (required for
        a multi-rank island; each island process its own); a random one when None. ``token``: its
        bearer token (coordinator ``--island-tokens``); ``tls``: TLS or mutual TLS.
        ``retry``: deadlines and backoff of every RPC. ``connect_timeout_seconds``: how long joining
        tries to reach the coordinator before it raises ``CoordinatorUnreachable`` (a WARNING is logged
        within seconds of the first failure, then every 30 s). ``heartbeat_seconds``: between lease
        renewals. ``pull_wait_seconds``: how long one long-poll for the outer step waits at the
        coordinator. ``bulk_streams``: the TCP connections each push and pull is striped over on the
        coordinator's bulk port (None: from the measured round trip: one on a LAN, one per 20 ms beyond,
        at most 8). ``connect(address)``: the transport of one shard (default: a :class:`WireTransport`
        over a :class:`~atoll.islands._transport.client.CoordinatorClient` with ``retry``, ``token``,
        ``tls`` and ``bulk_streams``).

        The constructor does no network I/O; :meth:`join` does."""
        self.addresses = parse_addresses(coordinator)
        if not connect_timeout_seconds > 0:
            raise ValueError(f"connect_timeout_seconds must be > 0, got {connect_timeout_seconds}")
        if not (heartbeat_seconds > 0 and pull_wait_seconds >= 0):
            raise ValueError("heartbeat_seconds must be > 0 and pull_wait_seconds >= 0")
        self.run_id = run_id
        self.island_id = island_id or f"island-{uuid.uuid4().hex[:8]}"
        self.named = island_id is not None
        """Whether the island id was given (a multi-rank island needs one its ranks share)."""
        self.session_id = uuid.uuid4().hex
        """This process's session: a second live process with the same island id is refused."""
        self.retry = retry or RetryPolicy()
        self.connect_timeout_seconds = connect_timeout_seconds
        self.heartbeat_seconds = heartbeat_seconds
        self.pull_wait_seconds = pull_wait_seconds
        self._connect = connect or (
            lambda address: WireTransport(
                CoordinatorClient(address, retry=self.retry, token=token, tls=tls, bulk_streams=bulk_streams)
            )
        )
        self.sessions: list[Session] = []
        """One per coordinator shard, once :meth:`open` ran."""
        self.stopping = threading.Event()
        """Set when the link closes: waits for outer steps give up."""
        self.preempted = threading.Event()
        """Set when the island got SIGTERM: calls retrying an unreachable coordinator end at once too
        (a leave still tries, for its own few seconds)."""
        self._group = None
        self._heartbeat: threading.Thread | None = None
        self.terms: IslandTerms | None = None
        """The run's terms as the Join answers settled them (:func:`atoll.islands._terms.settle`), once joined."""

    # ---- membership ------------------------------------------------------------------------------
    def open(self, rank: int, num_ranks: int, requests: list, regions: list, group=None) -> list[Session]:
        """Connect to every shard (no call yet): ``requests[i]()`` builds shard i's JoinRequest and
        ``regions[i]`` lists what this rank pulls from it."""
        if self.sessions:
            raise RuntimeError("the link is open already (one DiLoCo per link)")
        self._group = group
        me = Identity(self.run_id, self.island_id, self.session_id, rank, num_ranks)
        self.sessions = [
            Session(
                i,
                transport_of(self._connect(address)),
                me,
                requests[i],
                regions[i],
                pull_wait_seconds=self.pull_wait_seconds,
            )
            for i, address in enumerate(self.addresses)
        ]
        for s in self.sessions:
            s.transport.cancel = self.preempted
        return self.sessions

    def preempt(self) -> None:
        """SIGTERM: waits for outer steps and calls retrying an unreachable coordinator give up now."""
        self.preempted.set()
        self.stopping.set()

    def join(self) -> list[JoinAnswer]:
        """Join every shard (CoordinatorRefused, CoordinatorUnreachable), then keep the lease with
        heartbeats: uploading θ_0, or waiting for another island's, can take longer than a lease."""
        joined = [s.join(give_up_seconds=self.connect_timeout_seconds) for s in self.sessions]
        self._heartbeat = threading.Thread(target=self._heartbeats, name="atoll-heartbeat", daemon=True)
        self._heartbeat.start()
        return joined

    def _heartbeats(self) -> None:
        while not self.stopping.wait(self.heartbeat_seconds):
            for s in list(self.sessions):
                try:
                    s.heartbeat()
                except (ValueError, AttributeError):  # channel closed under us during shutdown
                    return
                except Exception as err:  # a heartbeat must never kill the island; the next one retries
                    log.info("heartbeat to shard %d failed: %s", s.index, err)

    def close(self, leave: bool = True) -> None:
        """Stop heartbeats and, on rank 0 with ``leave``, leave the run; close the channels."""
        self.stopping.set()
        if self._heartbeat is not None:
            self._heartbeat.join(timeout=5)
            self._heartbeat = None
        if not self.sessions:
            return
        me = self.sessions[0].me
        if me.num_ranks > 1:
            with contextlib.suppress(RuntimeError):  # a peer may already be gone
                dist.barrier(group=self._group)
        if leave and me.rank == 0:
            for s in self.sessions:
                s.leave()
        for s in self.sessions:
            s.transport.close()

    def bytes(self, indices: list[int]) -> tuple[int, int]:
        """Bytes sent and received so far on the given shards' transports."""
        return (
            sum(self.sessions[i].transport.bytes_sent for i in indices),
            sum(self.sessions[i].transport.bytes_received for i in indices),
        )


__all__ = ["ClientTls", "CoordinatorLink", "RetryPolicy", "Transport", "WireTransport"]
