"""What both ends of the atoll.v1 protocol share: method names, chunk size, channel options, and the
framing of the bulk streams (one chunker, one reassembler).

A push or pull stream is a header message, then ``data`` chunks holding the header's entries'
payloads concatenated in order. Chunks travel on the raw path (:mod:`atoll.protos.raw`).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from atoll.protos.raw import RawData

SERVICE_NAME = "atoll.v1.Coordinator"
CHUNK_BYTES = 1 << 20
"""Payload bytes per data chunk: gRPC messages stay small, and the receiver's buffers follow what arrived."""
MAX_MESSAGE_BYTES = 16 << 20


def method(name: str) -> str:
    return f"/{SERVICE_NAME}/{name}"


SERVER_OPTIONS = [
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.keepalive_time_ms", 30_000),
    ("grpc.keepalive_timeout_ms", 20_000),
    ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
    ("grpc.keepalive_permit_without_calls", 1),
]
CLIENT_OPTIONS = [
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.min_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 2000),
    # Keep NAT/WAN paths open during long inner loops, without upsetting the server's ping policy.
    ("grpc.keepalive_time_ms", 30_000),
    ("grpc.keepalive_timeout_ms", 20_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
]


def data_chunks(payloads: Iterable) -> Iterator[RawData]:
    """The payloads (bytes-like), cut into data chunks of at most :data:`CHUNK_BYTES`."""
    for payload in payloads:
        view = memoryview(payload).cast("B")
        for start in range(0, view.nbytes, CHUNK_BYTES):
            yield RawData(view[start : start + CHUNK_BYTES])


class StreamOverrun(ValueError):
    """A stream carried more bytes than its header declares."""


class EntryAssembler:
    """Cuts the data chunks of a stream into the entries its header declares.

    An entry's bytes are kept as the chunks that brought them and joined once the entry is complete,
    so memory follows the bytes actually received, never a size a header declares."""

    def __init__(self, sizes: list[int]) -> None:
        self.sizes = sizes
        self.index = 0
        self._parts: list[memoryview] = []
        self._filled = 0
        self.received = 0

    @property
    def done(self) -> bool:
        return self.index >= len(self.sizes)

    def feed(self, data: memoryview) -> list[tuple[int, bytes]]:
        """Take one chunk; returns the entries it completed, as (index, payload)."""
        out = []
        self.received += data.nbytes
        while data.nbytes:
            if self.done:
                raise StreamOverrun("the stream carries more bytes than its header declares")
            take = min(self.sizes[self.index] - self._filled, data.nbytes)
            self._parts.append(data[:take])
            self._filled += take
            data = data[take:]
            if self._filled == self.sizes[self.index]:
                out.append((self.index, b"".join(self._parts)))
                self._parts, self._filled = [], 0
                self.index += 1
        # Zero-byte entries complete without data.
        while not self.done and self.sizes[self.index] == 0:
            out.append((self.index, b""))
            self.index += 1
        return out

    def discard(self) -> None:
        """Drop the bytes of an entry still incomplete."""
        self._parts, self._filled = [], 0

    def finish(self) -> list[tuple[int, bytes]]:
        """Entries of zero bytes left at the end; StreamOverrun-free check that all are complete."""
        return self.feed(memoryview(b""))
