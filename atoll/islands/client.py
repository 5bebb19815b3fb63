"""A blocking gRPC client for the coordinator, with deadlines and retries on every RPC.

Every RPC is retried with capped exponential backoff while the coordinator is unreachable or
busy (UNAVAILABLE, DEADLINE_EXCEEDED, RESOURCE_EXHAUSTED), for at most
``RetryPolicy.give_up_seconds``; pushes are idempotent per (island, round, rank) on the server,
so retrying them is safe. A coordinator that stays unreachable is reported at WARNING (which
Python prints to stderr without any logging setup) within seconds, and again periodically.
"""

from __future__ import annotations

import itertools
import logging
import queue
import random
import re
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TypeVar

import grpc

from atoll.islands.bulk import BulkClient, BulkUnreachable, encoded
from atoll.islands.errors import PartialUpdate, ProtocolError, WrongEndpoint
from atoll.islands.probe import diagnose
from atoll.protos import coordinator_pb2 as pb
from atoll.protos import coordinator_pb2_grpc as pb_grpc
from atoll.protos.bulk import BulkError
from atoll.protos.raw import RawData
from atoll.protos.rpc import (
    CLIENT_OPTIONS,
    DURABLE_WAIT_SECONDS,
    BufferPool,
    ChunkPacker,
    EntryAssembler,
    StreamOverrun,
    bulk_calls,
    data_chunks,
)

log = logging.getLogger("atoll.island")

RETRYABLE = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.RESOURCE_EXHAUSTED}
T = TypeVar("T")
_ADDRESS = re.compile(r"^(?:\[(?P<v6>[0-9A-Fa-f:.]+)\]|(?P<host>[A-Za-z0-9_.-]+)):(?P<port>[0-9]{1,5})$")


def parse_address(address: str) -> tuple[str, int]:
    """``host:port`` or ``[ipv6]:port`` -> (host, port); ValueError saying what is wrong otherwise."""
    a = address.strip()
    if "://" in a:
        raise ValueError(f"coordinator address {address!r}: give host:port, without a scheme ({a.split('://')[0]}://)")
    m = _ADDRESS.match(a)
    if m is None:
        if a and ":" not in a:
            raise ValueError(f"coordinator address {address!r} has no port: give host:port, e.g. {a}:7070")
        raise ValueError(f"coordinator address {address!r} is not host:port (e.g. coord.example:7070, [::1]:7070)")
    port = int(m.group("port"))
    if not 0 < port < 65536:
        raise ValueError(f"coordinator address {address!r}: port {port} is outside 1..65535")
    return m.group("v6") or m.group("host"), port


def parse_addresses(coordinator: str) -> list[str]:
    """A coordinator, or its shards comma-separated, each validated (ValueError)."""
    addresses = [a.strip() for a in coordinator.split(",") if a.strip()]
    if not addresses:
        raise ValueError("coordinator must be host:port, or a comma-separated list of its shards")
    for a in addresses:
        parse_address(a)
    return addresses


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
PULL_BUFFER_BYTES = 512 << 20
"""Entry buffers an island keeps for its next pulls (one entry is held at a time: the largest few)."""


@dataclass(frozen=True, kw_only=True)
class ClientTls:
    ca: str
    """PEM file of the CA that signed the coordinator's certificate."""
    cert: str | None = None
    """PEM certificate of this island (mutual TLS)."""
    key: str | None = None
    """PEM private key of this island (mutual TLS)."""
    server_name: str | None = None
    """Expected name in the coordinator's certificate, if not the address's host."""

    def credentials(self) -> grpc.ChannelCredentials:
        def read(path):
            with open(path, "rb") as f:
                return f.read()

        return grpc.ssl_channel_credentials(
            root_certificates=read(self.ca),
            private_key=read(self.key) if self.key else None,
            certificate_chain=read(self.cert) if self.cert else None,
        )


class CoordinatorClient:
    def __init__(
        self, address: str, *, retry: RetryPolicy | None = None, token: str | None = None, tls: ClientTls | None = None
    ) -> None:
        parse_address(address)
        self.address = address
        self.retry = retry or RetryPolicy()
        self._metadata = (("authorization", f"Bearer {token}"),) if token else None
        if tls is not None:
            name = [("grpc.ssl_target_name_override", tls.server_name)] if tls.server_name else []
            self._channel = grpc.secure_channel(address, tls.credentials(), options=CLIENT_OPTIONS + name)
        else:
            self._channel = grpc.insecure_channel(address, options=CLIENT_OPTIONS)
        self._stub = pb_grpc.CoordinatorStub(self._channel)
        self._push_call, self._pull_call = bulk_calls(self._channel)
        self._auth = f"Bearer {token}" if token else ""
        self._said_unchecked = False
        self.tls = tls
        self.bulk: BulkClient | None = None
        """The coordinator's bulk port, once a Join advertised one (never over TLS): pushes and
        pulls go there, and back to gRPC if it cannot be reached."""
        self.bytes_sent = 0
        self.bytes_received = 0
        self.buffers = BufferPool(PULL_BUFFER_BYTES)
        """Entry buffers of pulls applied entry by entry, reused round after round (no page faults)."""

    def close(self) -> None:
        self._channel.close()

    def call(self, what: str, fn: Callable[[], T], *, give_up_seconds: float | None = None, probe: bool = False) -> T:
        """Run ``fn`` (one attempt of an RPC), retrying while the coordinator is unreachable or busy.
        ``probe``: at the first UNAVAILABLE, find out whether the island's setup is the cause (TLS
        against plaintext, a client certificate, the admin port: :mod:`atoll.islands.probe`) and raise
        WrongEndpoint saying so, rather than retrying what cannot work."""
        give_up = self.retry.give_up_seconds if give_up_seconds is None else give_up_seconds
        started = time.monotonic()
        warned_at = None
        backoff = self.retry.initial_backoff_seconds
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
                time.sleep(min(backoff * (0.5 + random.random() / 2), max(give_up - waited, 0.0)))
                backoff = min(backoff * 2, self.retry.max_backoff_seconds)

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
        if resp.bulk_port and self.tls is None:
            host = parse_address(self.address)[0]
            self.bulk = BulkClient(host, resp.bulk_port, auth=self._auth, timeout=self.retry.rpc_timeout_seconds)
        return resp

    def _on_bulk(self, what: str, attempt: Callable[[BulkClient], T], *, retried: bool = True) -> T | None:
        """``attempt`` on the bulk port, retried like any call (``retried``); None when there is no
        bulk port (or it cannot be reached: it is then dropped until the next Join, and the caller
        uses gRPC)."""
        bulk = self.bulk  # a re-join (the heartbeat thread) may replace it meanwhile
        if bulk is None:
            return None
        try:
            return self.call(what, lambda: attempt(bulk)) if retried else attempt(bulk)
        except BulkUnreachable as err:
            log.warning("%s: %s; pushing and pulling over gRPC until the next join", what, err)
            if self.bulk is bulk:
                self.bulk = None
            return None

    def heartbeat(self, req: pb.HeartbeatRequest) -> pb.HeartbeatResponse:
        return self._stub.Heartbeat(req, timeout=self.retry.rpc_timeout_seconds, metadata=self._metadata)

    def leave(self, req: pb.LeaveRequest, *, give_up_seconds: float | None = None) -> pb.LeaveResponse:
        return self.call(
            "Leave",
            lambda: self._stub.Leave(req, timeout=self._timeout(), metadata=self._metadata),
            give_up_seconds=give_up_seconds,
        )

    def push_chunks(self, header: pb.PushHeader, chunks: Iterable) -> pb.PushResponse:
        """One attempt at a push whose data chunks the caller cuts (:func:`~atoll.protos.rpc.data_chunks`
        of its payloads): no retry. What :meth:`push` does below its retries and streaming."""
        total = sum(e.num_bytes for e in header.entries)
        pieces = (p for c in chunks for p in ([c.view] if c.parts is None else c.parts))
        resp = self._on_bulk("PushDelta", lambda port: port.push(header, pieces), retried=False)
        if resp is not None:
            self.bytes_sent += total + header.ByteSize()
            return resp
        messages = itertools.chain([pb.PushChunk(header=header)], chunks)
        resp = self._push_call(messages, timeout=self._timeout(total), metadata=self._metadata)
        self.bytes_sent += total + header.ByteSize()
        return resp

    def push(self, header: pb.PushHeader, payloads) -> pb.PushResponse:
        """Stream one push: the header, then the payloads' bytes in chunks.

        ``payloads``: the entries' payloads, or a function ``encode(i)`` that returns entry i's (of the
        size the header declares). Then each entry is encoded on this (the calling) thread while the
        previous one is on the wire, and no more than two are held at once; an attempt that is
        retried encodes again, so ``encode`` must give the same bytes each time."""
        total = sum(e.num_bytes for e in header.entries)
        resp = self._on_bulk("PushDelta", lambda port: port.push(header, payloads))
        if resp is not None:
            self.bytes_sent += total + header.ByteSize()
            return resp
        if not callable(payloads):
            return self.call("PushDelta", lambda: self.push_chunks(header, data_chunks(payloads)))

        def streamed() -> pb.PushResponse:
            ready: queue.Queue = queue.Queue()
            alive = threading.Semaphore(2)  # entries in memory: the one on the wire and the next

            def chunks():
                yield pb.PushChunk(header=header)
                packer = ChunkPacker()
                while (payload := ready.get()) is not None:
                    yield from packer.add(payload)
                    del payload
                    alive.release()
                yield from packer.flush()

            call = self._push_call.future(chunks(), timeout=self._timeout(total), metadata=self._metadata)
            try:
                for i in range(len(header.entries)):
                    if not _acquire(alive, call):
                        break  # answered before reading everything (a duplicate, a closed round)
                    payload = encoded(header, payloads, i)
                    ready.put(payload)
                    del payload
                ready.put(None)
                resp = call.result()
            except BaseException:
                call.cancel()
                ready.put(None)  # let the request stream end
                raise
            self.bytes_sent += total + header.ByteSize()
            return resp

        return self.call("PushDelta", streamed)

    def pull(self, req: pb.PullRequest, on_entry=None) -> tuple[pb.UpdateHeader, list[tuple[str, bytes]]]:
        """One long-poll pull; returns the header and each entry's payload.

        ``on_entry(header, i, payload)``: hand each entry over as soon as its bytes are in instead
        (the payloads list is then empty), so no more than one entry is held; the payload must not be
        kept once it returns (its buffer takes the next entries). Once an entry was handed over the
        pull is not retried: a broken stream raises :class:`PartialUpdate`."""

        def on_port(port: BulkClient):
            try:
                header, payloads, received = port.pull(req, on_entry, self.buffers)
            except BulkError as err:
                if getattr(err, "handed", 0):
                    raise PartialUpdate(f"the update stream broke after {err.handed} entries: {err.details()}") from err
                raise
            self.bytes_received += received + header.ByteSize()
            if on_entry is not None:
                return header, []
            return header, [(e.name, p) for e, p in zip(header.entries, payloads, strict=True)]

        pulled = self._on_bulk("PullUpdate", on_port)
        if pulled is not None:
            return pulled

        def attempt():
            timeout = self._timeout() + req.wait_seconds + DURABLE_WAIT_SECONDS
            stream = self._pull_call(req, timeout=timeout, metadata=self._metadata)
            header, assembler, payloads, handed, durable = None, None, [], 0, None
            try:
                for chunk in stream:
                    if durable is not None:
                        raise ProtocolError("update stream data after its confirmation")
                    if isinstance(chunk, RawData) or chunk.WhichOneof("kind") == "data":
                        if assembler is None:
                            raise ProtocolError("update stream data before its header")
                        data = chunk.view if isinstance(chunk, RawData) else memoryview(chunk.data)
                        try:
                            done = assembler.feed(data)
                        except StreamOverrun as err:
                            raise ProtocolError(str(err)) from None
                        handed += _deliver(done, header, on_entry, payloads, self.buffers)
                    elif chunk.WhichOneof("kind") == "durable":
                        if header is None or not header.tentative or chunk.durable.round != header.round:
                            raise ProtocolError("an update stream's confirmation does not match its header")
                        durable = chunk.durable
                    elif header is not None:
                        raise ProtocolError("two headers in one update stream")
                    else:
                        header = chunk.header
                        pool = self.buffers if on_entry is not None else None  # entries read no more once applied
                        assembler = EntryAssembler([e.num_bytes for e in header.entries], pool)
                if header is None:
                    raise ProtocolError("update stream without a header")
                handed += _deliver(assembler.finish(), header, on_entry, payloads, self.buffers)
                if not assembler.done:
                    raise ProtocolError(f"update stream carried {assembler.received} bytes, header declares more")
                if header.tentative and durable is None:  # installed only once the round is saved
                    raise PartialUpdate("the update stream ended before its round was confirmed saved")
            except grpc.RpcError as err:
                if handed:
                    raise PartialUpdate(f"the update stream broke after {handed} entries: {err.details()}") from err
                raise
            self.bytes_received += assembler.received + header.ByteSize()
            if on_entry is not None:
                return header, []
            return header, [(e.name, p) for e, p in zip(header.entries, payloads, strict=True)]

        return self.call("PullUpdate", attempt)


def _deliver(done: list, header, on_entry, payloads: list, pool: BufferPool) -> int:
    if on_entry is None:
        payloads += [p for _, p in done]
        return 0
    for i, payload in done:
        on_entry(header, i, payload)  # applied: the payload is read no more
        pool.give(payload)
    return len(done)


def _acquire(alive: threading.Semaphore, call) -> bool:
    """Wait for room for one more entry; False once the call has ended (it reads no more)."""
    while not call.done():
        if alive.acquire(timeout=0.1):
            return True
    return False


__all__ = [
    "ClientTls",
    "CoordinatorClient",
    "PartialUpdate",
    "ProtocolError",
    "RetryPolicy",
    "parse_address",
    "parse_addresses",
]
