"""A blocking gRPC client for the coordinator, with deadlines and retries on every RPC.

Every RPC is retried with capped exponential backoff while the coordinator is unreachable
(UNAVAILABLE / DEADLINE_EXCEEDED), for at most ``RetryPolicy.give_up_seconds``; pushes are
idempotent per (island, round, rank) on the server, so retrying them is safe.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TypeVar

import grpc

from atoll.protos import coordinator_pb2 as pb
from atoll.protos import coordinator_pb2_grpc as pb_grpc
from atoll.protos import raw
from atoll.protos.raw import RawData

log = logging.getLogger("atoll.island")

CHUNK_BYTES = 1 << 20
CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", 16 << 20),
    ("grpc.max_send_message_length", 16 << 20),
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.min_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 2000),
    # Keep NAT/WAN paths open during long inner loops, without upsetting the server's ping policy.
    ("grpc.keepalive_time_ms", 30_000),
    ("grpc.keepalive_timeout_ms", 20_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
]
RETRYABLE = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED}
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

    def __post_init__(self) -> None:
        if not 0 < self.initial_backoff_seconds <= self.max_backoff_seconds:
            raise ValueError("need 0 < initial_backoff_seconds <= max_backoff_seconds")
        if self.give_up_seconds <= 0 or self.rpc_timeout_seconds <= 0:
            raise ValueError("give_up_seconds and rpc_timeout_seconds must be > 0")


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
        self.address = address
        self.retry = retry or RetryPolicy()
        self._metadata = (("authorization", f"Bearer {token}"),) if token else None
        if tls is not None:
            name = [("grpc.ssl_target_name_override", tls.server_name)] if tls.server_name else []
            self._channel = grpc.secure_channel(address, tls.credentials(), options=CHANNEL_OPTIONS + name)
        else:
            self._channel = grpc.insecure_channel(address, options=CHANNEL_OPTIONS)
        self._stub = pb_grpc.CoordinatorStub(self._channel)
        # The bulk streams on the raw chunk path (wire-compatible; see atoll.protos.raw).
        self._push_call = self._channel.stream_unary(
            "/atoll.v1.Coordinator/PushDelta",
            request_serializer=raw.serialize,
            response_deserializer=pb.PushResponse.FromString,
        )
        self._pull_call = self._channel.unary_stream(
            "/atoll.v1.Coordinator/PullUpdate",
            request_serializer=pb.PullRequest.SerializeToString,
            response_deserializer=raw.deserialize_pull_chunk,
        )
        self.bytes_sent = 0
        self.bytes_received = 0

    def close(self) -> None:
        self._channel.close()

    def call(self, what: str, fn: Callable[[], T]) -> T:
        """Run ``fn`` (one attempt of an RPC), retrying while the coordinator is unreachable."""
        started = time.monotonic()
        backoff = self.retry.initial_backoff_seconds
        while True:
            try:
                return fn()
            except grpc.RpcError as err:
                code = err.code() if hasattr(err, "code") else None
                waited = time.monotonic() - started
                if code not in RETRYABLE or waited >= self.retry.give_up_seconds:
                    raise
                log.info("%s: %s (%s), retrying in %.1fs", what, code, err.details(), backoff)
                time.sleep(backoff * (0.5 + random.random() / 2))
                backoff = min(backoff * 2, self.retry.max_backoff_seconds)

    def _timeout(self, num_bytes: int = 0) -> float:
        # Allow for the transfer itself on slow links (assume >= 1 MB/s) on top of the RPC deadline.
        return self.retry.rpc_timeout_seconds + num_bytes / 1e6

    def join(self, req: pb.JoinRequest) -> pb.JoinResponse:
        return self.call("Join", lambda: self._stub.Join(req, timeout=self._timeout(), metadata=self._metadata))

    def heartbeat(self, req: pb.HeartbeatRequest) -> pb.HeartbeatResponse:
        return self._stub.Heartbeat(req, timeout=self.retry.rpc_timeout_seconds, metadata=self._metadata)

    def leave(self, req: pb.LeaveRequest) -> pb.LeaveResponse:
        return self.call("Leave", lambda: self._stub.Leave(req, timeout=self._timeout(), metadata=self._metadata))

    def push(self, header: pb.PushHeader, payloads: list[bytes]) -> pb.PushResponse:
        """Stream one push (header, then the payloads' bytes in chunks)."""
        total = sum(len(p) for p in payloads)

        def chunks() -> Iterator[pb.PushChunk]:
            yield pb.PushChunk(header=header)
            for payload in payloads:
                view = memoryview(payload)
                for start in range(0, len(view), CHUNK_BYTES):
                    yield RawData(view[start : start + CHUNK_BYTES])

        def attempt() -> pb.PushResponse:
            resp = self._push_call(chunks(), timeout=self._timeout(total), metadata=self._metadata)
            self.bytes_sent += total + header.ByteSize()
            return resp

        return self.call("PushDelta", attempt)

    def pull(self, req: pb.PullRequest) -> tuple[pb.UpdateHeader, list[tuple[str, bytes]]]:
        """One long-poll pull; returns the header and each entry's payload."""

        def attempt():
            stream = self._pull_call(req, timeout=self._timeout() + req.wait_seconds, metadata=self._metadata)
            header = None
            data = bytearray()
            for chunk in stream:
                if isinstance(chunk, RawData):
                    data += chunk.view
                elif chunk.WhichOneof("kind") == "header":
                    if header is not None:
                        raise ProtocolError("two headers in one update stream")
                    header = chunk.header
                else:
                    data += chunk.data
            if header is None:
                raise ProtocolError("update stream without a header")
            expected = sum(e.num_bytes for e in header.entries)
            if len(data) != expected:
                raise ProtocolError(f"update stream carried {len(data)} bytes, header declares {expected}")
            self.bytes_received += len(data) + header.ByteSize()
            payloads, pos, view = [], 0, memoryview(data)
            for e in header.entries:
                payloads.append((e.name, bytes(view[pos : pos + e.num_bytes])))
                pos += e.num_bytes
            return header, payloads

        return self.call("PullUpdate", attempt)


class ProtocolError(RuntimeError):
    """The coordinator sent something that breaks the protocol."""
