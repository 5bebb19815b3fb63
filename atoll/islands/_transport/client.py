"""The island's client of one coordinator (shard), with deadlines and retries on every call.

The control calls (Join, Heartbeat, Leave) go over gRPC; a push or a pull goes over the coordinator's
bulk port when its Join advertised one (and back to gRPC if it cannot be reached), else over gRPC:
either way one writer and one reader (:mod:`atoll.islands._transport.transfer`) over a stream of the
transport's (:mod:`atoll.islands._transport.streams`).

Every RPC is retried with capped exponential backoff while the coordinator is unreachable or
busy (UNAVAILABLE, DEADLINE_EXCEEDED, RESOURCE_EXHAUSTED), for at most
``RetryPolicy.give_up_seconds``; pushes are idempotent per (island, round, rank) on the server,
so retrying them is safe. A coordinator that stays unreachable is reported at WARNING (which
Python prints to stderr without any logging setup) within seconds, and again periodically.
"""

from __future__ import annotations

import contextlib
import logging
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import grpc

from atoll.islands._transport.addresses import alternatives, parse_address, parse_addresses
from atoll.islands._transport.kept import KeptConnections
from atoll.islands._transport.opening import AUTO_MAX_STREAMS, BulkPort, BulkUnreachable, auto_streams, connect
from atoll.islands._transport.probe import diagnose
from atoll.islands._transport.streams import GrpcPull, GrpcPush
from atoll.islands._transport.tcp_streams import TcpPull, TcpPush
from atoll.islands._transport.tls import ClientTls
from atoll.islands._transport.transfer import read_update, write_push
from atoll.islands.errors import PartialUpdate, ProtocolError, Stopping, WrongEndpoint
from atoll.protos import coordinator_pb2 as pb
from atoll.protos import coordinator_pb2_grpc as pb_grpc
from atoll.protos.bulk import broken as bulk_broken
from atoll.protos.rpc import CLIENT_OPTIONS, DURABLE_WAIT_SECONDS, BufferPool, tensor_calls

log = logging.getLogger("atoll.island")

RETRYABLE = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.RESOURCE_EXHAUSTED}
T = TypeVar("T")


@dataclass(frozen=True, kw_only=True)
class RetryPolicy:
    initial_backoff_seconds: float = 0.2
    """First wait after a failed attempt."""
    max_backoff_seconds: float = 5.0
    """Cap on the wait between attempts."""
    give_up_seconds: float = 600.0
    """Stop retrying (and raise) once the coordinator has been unreachable this long."""
    rpc_timeout_seconds: float = 60.0
    """Deadline of one unary attempt (streams get this plus their transfer allowance)."""
    warn_after_seconds: float = 3.0
    """Report an unreachable coordinator at WARNING once it has failed this long, then every 30 s."""

    def __post_init__(self) -> None:
        if not 0 < self.initial_backoff_seconds <= self.max_backoff_seconds:
            raise ValueError("need 0 < initial_backoff_seconds <= max_backoff_seconds")
        if self.give_up_seconds <= 0 or self.rpc_timeout_seconds <= 0:
            raise ValueError("give_up_seconds and rpc_timeout_seconds must be > 0")


WARN_EVERY_SECONDS = 30.0
STANDBY_BACKOFF_SECONDS = 0.5
"""The longest wait between rounds of attempts while a coordinator with standbys is unreachable: one
takes over within its lease (``atoll coordinator --standby``), and a connection refused costs nothing."""
PULL_BUFFER_BYTES = 512 << 20
"""Entry buffers an island keeps for its next pulls (one entry is held at a time: the largest few)."""


class CoordinatorClient:
    def __init__(
        self,
        address: str,
        *,
        retry: RetryPolicy | None = None,
        token: str | None = None,
        tls: ClientTls | None = None,
        bulk_streams: int | None = None,
    ) -> None:
        """``bulk_streams``: the TCP connections each push and pull is striped over on the bulk port
        (None: from the measured round trip, :func:`~atoll.islands._transport.opening.auto_streams`)."""
        self.alternatives = alternatives(address)
        """This coordinator's addresses: the one in use first; after it, standbys tried in turn while
        it is unreachable (a coordinator that took the run over from the object store)."""
        if bulk_streams is not None and not 1 <= bulk_streams <= 16:
            raise ValueError(f"bulk_streams={bulk_streams}: 1 to 16, or None to choose from the round trip")
        self.bulk_streams = bulk_streams
        self.rtt: float | None = None
        """The shortest round trip to the bulk port seen so far (a TCP handshake's)."""
        self.address = self.alternatives[0]
        self.retry = retry or RetryPolicy()
        self.cancel: threading.Event | None = None
        """Set when the island stops (SIGTERM): retries between attempts end (:meth:`call`)."""
        self._metadata = (("authorization", f"Bearer {token}"),) if token else None
        self.tls = tls
        self._retired: list = []
        self._open_channel()
        self._auth = f"Bearer {token}" if token else ""
        self._said_unchecked = False
        self._bulk_tls = tls.ssl_context() if tls is not None else None
        self.bulk: BulkPort | None = None
        """The coordinator's bulk port, once a Join advertised one (over TLS when gRPC is): pushes and
        pulls go there, and back to gRPC if it cannot be reached."""
        self.bytes_sent = 0
        self.bytes_received = 0
        self.kept = KeptConnections()
        """Bulk-port connections kept between calls (when the coordinator keeps them too)."""
        self.buffers = BufferPool(PULL_BUFFER_BYTES)
        """Entry buffers of pulls applied entry by entry, reused round after round (no page faults)."""
        self.moved = False
        """The coordinator in use changed and no pull has been answered by the new one yet: the next
        pull asks without waiting (a standby that took over may lack our push: it says so at once,
        rather than after the long-poll, and the island pushes again)."""

    def _open_channel(self) -> None:
        tls = self.tls
        # With standbys, a channel of its own connections: gRPC shares connections (and their reconnect
        # backoff, up to 2 s) between channels to one address, so a fresh channel to a standby that has
        # just started serving would still fail fast, as the ones that found it down did.
        options = CLIENT_OPTIONS + ([("grpc.use_local_subchannel_pool", 1)] if len(self.alternatives) > 1 else [])
        if tls is not None:
            name = [("grpc.ssl_target_name_override", tls.server_name)] if tls.server_name else []
            self._channel = grpc.secure_channel(self.address, tls.credentials(), options=options + name)
        else:
            self._channel = grpc.insecure_channel(self.address, options=options)
        self._stub = pb_grpc.CoordinatorStub(self._channel)
        self._push_call, self._pull_call = tensor_calls(self._channel)

    def _try_standby(self) -> bool:
        """The coordinator in use is unreachable: the next of its addresses (its bulk port and kept
        connections go with it; the next Join says the new one's). False when it has none."""
        if len(self.alternatives) < 2:
            return False
        i = self.alternatives.index(self.address)
        old, self.address = self.address, self.alternatives[(i + 1) % len(self.alternatives)]
        self._retired.append(self._channel)  # (another thread may be in a call on it: closed at close())
        self._open_channel()
        self.bulk = None
        self.moved = True
        kept, self.kept = self.kept, KeptConnections()
        kept.close()  # (a call still running on an old connection closes it when it ends)
        log.info("coordinator %s unreachable: trying %s", old, self.address)
        return True

    def close(self) -> None:
        for channel in [*self._retired, self._channel]:
            channel.close()
        self._retired = []
        self.kept.close()

    def call(
        self,
        what: str,
        fn: Callable[[], T],
        *,
        give_up_seconds: float | None = None,
        probe: bool = False,
        cancellable: bool = True,
    ) -> T:
        """Run ``fn`` (one attempt of an RPC), retrying while the coordinator is unreachable or busy.
        ``probe``: at the first UNAVAILABLE, find out whether the island's setup is the cause (TLS
        against plaintext, a client certificate, the admin port: :mod:`atoll.islands.probe`) and raise
        WrongEndpoint saying so, rather than retrying what cannot work. Once :attr:`cancel` is set (the
        island got SIGTERM) the retries end at once with Stopping, unless not ``cancellable`` (a leave,
        which its own short deadline bounds): a preempted island keeps its exit deadline however long
        the coordinator stays away."""
        give_up = self.retry.give_up_seconds if give_up_seconds is None else give_up_seconds
        started = time.monotonic()
        warned_at = None
        backoff = self.retry.initial_backoff_seconds
        cycle = {self.address}
        """The addresses tried since the last wait: a standby is tried at once, the wait comes once all were."""
        while True:
            try:
                return fn()
            except grpc.RpcError as err:
                code = err.code() if hasattr(err, "code") else None
                if probe and code == grpc.StatusCode.UNAVAILABLE:
                    probe = False  # once: a coordinator that is down is retried as before
                    problem = diagnose(*parse_address(self.address), self.tls)
                    if problem is not None:
                        raise WrongEndpoint(problem) from None
                waited = time.monotonic() - started
                if code not in RETRYABLE or waited >= give_up:
                    if code in RETRYABLE:
                        log.error(
                            "%s: coordinator %s still %s after %.0fs; giving up", what, self.address, code.name, waited
                        )
                    raise
                busy = code == grpc.StatusCode.RESOURCE_EXHAUSTED
                if code == grpc.StatusCode.UNAVAILABLE and self._try_standby() and self.address not in cycle:
                    cycle.add(self.address)
                    continue
                cycle = {self.address}
                if (
                    not busy
                    and waited >= self.retry.warn_after_seconds
                    and (warned_at is None or time.monotonic() - warned_at >= WARN_EVERY_SECONDS)
                ):
                    log.warning(
                        "%s: coordinator %s unreachable for %.0fs (%s: %s); retrying for up to %.0fs more",
                        what,
                        self.address,
                        waited,
                        code.name,
                        err.details(),
                        give_up - waited,
                    )
                    warned_at = time.monotonic()
                else:
                    log.info("%s: %s (%s), retrying in %.1fs", what, code.name, err.details(), backoff)
                pause = min(backoff * (0.5 + random.random() / 2), max(give_up - waited, 0.0))
                if self.cancel is not None and cancellable:
                    if self.cancel.wait(pause):
                        raise Stopping(f"{what}: the island is stopping; its retries to {self.address} end") from None
                else:
                    time.sleep(pause)
                cap = self.retry.max_backoff_seconds
                if len(self.alternatives) > 1 and not busy:  # a standby takes over within seconds: look often
                    cap = min(cap, STANDBY_BACKOFF_SECONDS)
                backoff = min(backoff * 2, cap)

    def _timeout(self, num_bytes: int = 0) -> float:
        # Allow for the transfer itself on slow links (assume >= 1 MB/s) on top of the RPC deadline.
        return self.retry.rpc_timeout_seconds + num_bytes / 1e6

    def join(self, req: pb.JoinRequest, *, give_up_seconds: float | None = None) -> pb.JoinResponse:
        resp = self.call(
            "Join",
            lambda: self._stub.Join(req, timeout=self._timeout(), metadata=self._metadata),
            give_up_seconds=give_up_seconds,
            probe=True,
        )
        if self._auth and not resp.checks_tokens and not self._said_unchecked:
            self._said_unchecked = True
            log.warning(
                "the coordinator at %s checks no island tokens (it runs without --island-tokens): the token this "
                "island sends protects nothing",
                self.address,
            )
        self.bulk = None
        if resp.bulk_port:
            server_name = self.tls.server_name if self.tls is not None else None
            host = parse_address(self.address)[0]
            self.bulk = BulkPort(
                host, resp.bulk_port, self._bulk_tls, server_name, max(resp.bulk_streams, 1), resp.bulk_keep_seconds
            )
            if self.rtt is None and self.bulk_streams is None:
                with contextlib.suppress(BulkUnreachable):  # (a port that cannot be reached says so at the push)
                    sock, rtt = connect(self.bulk)
                    sock.close()
                    self._saw_rtt(rtt)
        return resp

    def heartbeat(self, req: pb.HeartbeatRequest) -> pb.HeartbeatResponse:
        return self._stub.Heartbeat(req, timeout=self.retry.rpc_timeout_seconds, metadata=self._metadata)

    def leave(self, req: pb.LeaveRequest, *, give_up_seconds: float | None = None) -> pb.LeaveResponse:
        return self.call(
            "Leave",
            lambda: self._stub.Leave(req, timeout=self._timeout(), metadata=self._metadata),
            give_up_seconds=give_up_seconds,
            cancellable=False,
        )

    def _transport(self, what: str, on_bulk: Callable[[BulkPort], T], on_grpc: Callable[[], T]) -> T:
        """One attempt of a push or a pull: on the bulk port when there is one (a port that cannot be
        reached is dropped until the next Join, and gRPC carries the call), else on gRPC."""
        bulk = self.bulk  # a re-join (the heartbeat thread) may replace it meanwhile
        if bulk is not None:
            try:
                return on_bulk(bulk)
            except BulkUnreachable as err:
                log.warning("%s: %s; pushing and pulling over gRPC until the next join", what, err)
                if self.bulk is bulk:
                    self.bulk = None
        return on_grpc()

    def _saw_rtt(self, rtt: float | None) -> None:
        if rtt is not None:  # (None: a call on kept connections only, no handshake to time)
            self.rtt = rtt if self.rtt is None else min(self.rtt, rtt)

    def streams_for(self, port: BulkPort) -> int:
        """The connections the next call on ``port`` is striped over."""
        if self.bulk_streams is not None:
            return min(self.bulk_streams, port.streams)
        return auto_streams(self.rtt, min(port.streams, AUTO_MAX_STREAMS))

    def _tcp(self, stream):
        self._saw_rtt(stream.rtt)
        return stream

    def open_push(self, header: pb.PushHeader, *, eager: bool = False):
        """The stream of one push attempt (its header sent), on the bulk port or on gRPC. ``eager``: its
        data goes without waiting for admission (a first attempt, of which the coordinator holds nothing)."""
        total = sum(e.num_bytes for e in header.entries)
        timeout = self.retry.rpc_timeout_seconds

        def on_bulk(port: BulkPort) -> TcpPush:
            streams = self.streams_for(port)
            return self._tcp(
                TcpPush(port, header, auth=self._auth, timeout=timeout, streams=streams, kept=self.kept, eager=eager)
            )

        return self._transport(
            "PushDelta",
            on_bulk,
            lambda: GrpcPush(self._push_call, header, timeout=self._timeout(total), metadata=self._metadata),
        )

    def push(self, header: pb.PushHeader, payloads) -> pb.PushResponse:
        """Push (retried): the header, then the payloads' bytes. ``payloads``: the entries' payloads in
        order (or any bytes-like pieces adding up to them), or ``encode(i)`` that gives entry i's (of
        the size the header declares), which is then encoded on this thread while the previous entry
        is on the wire (two held at most); an attempt that is retried encodes again."""

        attempts = 0

        def attempt() -> pb.PushResponse:
            nonlocal attempts
            attempts += 1  # the first goes without waiting a round trip for admission; a retry may resume
            resp = write_push(self.open_push(header, eager=attempts == 1), header, payloads)
            self.bytes_sent += sum(e.num_bytes for e in header.entries) + header.ByteSize()
            return resp

        return self.call("PushDelta", attempt)

    def pull(self, req: pb.PullRequest, on_entry=None) -> tuple[pb.UpdateHeader, list[tuple[str, object]]]:
        """One long-poll pull (retried); returns the header and each entry's (name, payload).

        ``on_entry(header, i, payload)``: hand each entry over as soon as its bytes are in instead (the
        payloads list is then empty), so no more than one entry is held; the payload must not be kept
        once it returns (its buffer takes the next entries). Once an entry was handed over the pull is
        not retried: a broken stream raises :class:`PartialUpdate`."""

        def reopen(offset: int):
            time.sleep(self.retry.initial_backoff_seconds)
            resumed = pb.PullRequest()
            resumed.CopyFrom(req)
            resumed.resume_offset = offset
            stream = self.open_pull(resumed)
            if not getattr(stream, "resumable", False):  # gRPC carries it now: it would start from the start
                stream.close()
                raise bulk_broken("the bulk port is gone; the pull cannot resume on gRPC")
            return stream

        def attempt():
            asked = req
            if self.moved and req.wait_seconds > 0:
                asked = pb.PullRequest()
                asked.CopyFrom(req)
                asked.wait_seconds = 0.0
            stream = self.open_pull(asked)
            header, payloads, received = read_update(stream, on_entry, self.buffers, DURABLE_WAIT_SECONDS, reopen)
            self.moved = False
            self.bytes_received += received + header.ByteSize()
            if on_entry is not None:
                return header, []
            return header, [(e.name, p) for e, p in zip(header.entries, payloads, strict=True)]

        return self.call("PullUpdate", attempt)

    def open_pull(self, req: pb.PullRequest):
        """The stream of one pull attempt, on the bulk port or on gRPC."""
        timeout = self.retry.rpc_timeout_seconds
        return self._transport(
            "PullUpdate",
            lambda port: self._tcp(
                TcpPull(port, req, auth=self._auth, timeout=timeout, streams=self.streams_for(port), kept=self.kept)
            ),
            lambda: GrpcPull(
                self._pull_call,
                req,
                timeout=self._timeout() + req.wait_seconds + DURABLE_WAIT_SECONDS,
                metadata=self._metadata,
            ),
        )


__all__ = [
    "BulkPort",
    "ClientTls",
    "CoordinatorClient",
    "PartialUpdate",
    "ProtocolError",
    "RetryPolicy",
    "parse_address",
    "parse_addresses",
]
