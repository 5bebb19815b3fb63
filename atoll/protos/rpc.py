"""What both ends of the atoll.v1 protocol share: method names, the server's handler table and the
client's calls (the bulk streams on the raw path), chunk size, channel options, and the framing of
the bulk streams (one chunker, one reassembler).

A push or pull stream is a header message, then ``data`` chunks holding the header's entries'
payloads concatenated in order. Chunks travel on the raw path (:mod:`atoll.protos.raw`).
"""

from __future__ import annotations

import mmap
import threading
from collections.abc import Callable, Iterable, Iterator

import grpc
import numpy as np

from atoll.protos import coordinator_pb2 as pb
from atoll.protos import raw
from atoll.protos.raw import RawData

SERVICE_NAME = "atoll.v1.Coordinator"
CHUNK_BYTES = 1 << 20
"""Payload bytes per data chunk: gRPC messages stay small, and the receiver's buffers follow what arrived."""
MAX_MESSAGE_BYTES = 16 << 20
DURABLE_WAIT_SECONDS = 60.0
"""How long a tentative update's stream waits for its round to be saved (then it ends, refused
NOT_DURABLE, and the island pulls again); clients allow for it in their deadlines."""


def method(name: str) -> str:
    return f"/{SERVICE_NAME}/{name}"


SERVER_OPTIONS = [
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.keepalive_time_ms", 30_000),
    ("grpc.keepalive_timeout_ms", 20_000),
    ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
    ("grpc.keepalive_permit_without_calls", 1),
    # One server per port: with SO_REUSEPORT (gRPC's default) a second coordinator on a served port
    # started without complaint and the kernel divided the islands between the two.
    ("grpc.so_reuseport", 0),
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


def server_handlers(servicer, parse: Callable[[Callable], Callable] = lambda f: f) -> dict[str, grpc.RpcMethodHandler]:
    """The coordinator's method table: each RPC of ``servicer`` with its (de)serializers, the bulk
    streams' chunks on the raw path (:mod:`atoll.protos.raw`). ``parse(from_bytes)`` wraps each
    request deserializer (the server's makes unparseable bytes answer INVALID_ARGUMENT)."""
    unary = grpc.unary_unary_rpc_method_handler
    return {
        "Join": unary(servicer.Join, parse(pb.JoinRequest.FromString), pb.JoinResponse.SerializeToString),
        "Heartbeat": unary(
            servicer.Heartbeat, parse(pb.HeartbeatRequest.FromString), pb.HeartbeatResponse.SerializeToString
        ),
        "PushDelta": grpc.stream_unary_rpc_method_handler(
            servicer.PushDelta, parse(raw.deserialize_push_chunk), pb.PushResponse.SerializeToString
        ),
        "PullUpdate": grpc.unary_stream_rpc_method_handler(
            servicer.PullUpdate, parse(pb.PullRequest.FromString), raw.serialize
        ),
        "Leave": unary(servicer.Leave, parse(pb.LeaveRequest.FromString), pb.LeaveResponse.SerializeToString),
    }


def tensor_calls(channel: grpc.Channel) -> tuple[grpc.StreamUnaryMultiCallable, grpc.UnaryStreamMultiCallable]:
    """The client's PushDelta and PullUpdate calls, their chunks on the raw path (wire-compatible with
    the generated stub's)."""
    push = channel.stream_unary(
        method("PushDelta"), request_serializer=raw.serialize, response_deserializer=pb.PushResponse.FromString
    )
    pull = channel.unary_stream(
        method("PullUpdate"),
        request_serializer=pb.PullRequest.SerializeToString,
        response_deserializer=raw.deserialize_pull_chunk,
    )
    return push, pull


class ChunkPacker:
    """Cuts payloads into data chunks of ``chunk_bytes``, packing small ones together: a model of many
    small tensors costs a few messages, not one per tensor (2000 tensors of 1 KiB: 2 messages).

    A small payload waits in the pending chunk (held, not copied); a large one completes the pending
    chunk with its first bytes and goes out in chunks of its own, none of it left waiting (so a
    streamed push holds no more of it once its chunks are sent)."""

    def __init__(self, chunk_bytes: int = CHUNK_BYTES) -> None:
        self.chunk_bytes = chunk_bytes
        self._parts: list[memoryview] = []
        self._size = 0

    def add(self, payload) -> list[RawData]:
        view = memoryview(payload).cast("B")
        cb = self.chunk_bytes
        if view.nbytes < cb // 2:
            out = self.flush() if self._size + view.nbytes > cb else []
            if view.nbytes:
                self._parts.append(view)
                self._size += view.nbytes
            return out
        head = cb - self._size
        out = [RawData.of([*self._parts, view[:head]])]
        self._parts, self._size = [], 0
        out += [RawData(view[start : start + cb]) for start in range(head, view.nbytes, cb)]
        return out

    def flush(self) -> list[RawData]:
        if not self._parts:
            return []
        parts, self._parts, self._size = self._parts, [], 0
        return [RawData(parts[0]) if len(parts) == 1 else RawData.of(parts)]


def data_chunks(payloads: Iterable, chunk_bytes: int = CHUNK_BYTES) -> Iterator[RawData]:
    """The payloads (bytes-like) as data chunks of at most ``chunk_bytes`` (:class:`ChunkPacker`)."""
    packer = ChunkPacker(chunk_bytes)
    for payload in payloads:
        yield from packer.add(payload)
    yield from packer.flush()


class StreamOverrun(ValueError):
    """A stream carried more bytes than its header declares."""


MAPPED_ENTRY_BYTES = 1 << 20
"""Entries this large get an anonymous mapping of their own (see :func:`entry_buffer`)."""


def entry_buffer(size: int) -> np.ndarray:
    """Room for one entry of ``size`` bytes that costs only the pages written into it.

    A large entry is an anonymous mapping of its own: pages become resident as bytes arrive and go
    back to the kernel when the entry is dropped (through the allocator they would be kept for reuse
    in some heap arena, where many concurrent pushes leave a lot of memory behind). A small one comes
    from the allocator."""
    if size < MAPPED_ENTRY_BYTES:
        return np.empty(size, dtype=np.uint8)
    return np.frombuffer(mmap.mmap(-1, size), dtype=np.uint8)


class BufferPool:
    """Large entry buffers kept for reuse, up to ``limit`` bytes in all.

    A buffer whose pages are resident fills at memory speed; a fresh mapping takes a page fault (and
    the kernel zeroes a page) every 4 KiB: filling 475 MiB of fresh mappings took about 0.28 s on
    the dev machine, a reused buffer about 0.04 s. A server that receives the same model's entries
    round after round takes them from here; what is given back past ``limit`` goes to the kernel.
    ``limit``: bytes, or a function that says them now (the coordinator's in-flight budget, which a
    joining island's model can raise). Thread-safe."""

    def __init__(self, limit: int | Callable[[], int], make: Callable[[int], np.ndarray] | None = None) -> None:
        """``make(size)``: a new buffer when none is free (default :func:`entry_buffer`; an island on an
        accelerator makes pinned ones, whose copy to the device runs at the link's full speed)."""
        self.limit = limit
        self.make = make or entry_buffer
        self.held = 0
        self.reused = 0
        """Buffers handed out again (a test and a benchmark read it)."""
        self._free: dict[int, list[np.ndarray]] = {}
        self._lock = threading.Lock()

    def take(self, size: int) -> np.ndarray:
        with self._lock:
            free = self._free.get(size)
            if free:
                self.held -= size
                self.reused += 1
                return free.pop()
        return self.make(size)

    def free_buffers(self) -> list[np.ndarray]:
        """The buffers kept for reuse now (for an account of the memory held)."""
        with self._lock:
            return [b for free in self._free.values() for b in free]

    def give(self, payload) -> None:
        """Take back a payload of :meth:`take`'s buffer (the caller no longer reads it)."""
        buf = memoryview(payload).obj
        if not isinstance(buf, np.ndarray) or buf.nbytes < MAPPED_ENTRY_BYTES:
            return
        limit = self.limit() if callable(self.limit) else self.limit
        with self._lock:
            if self.held + buf.nbytes <= limit:
                self._free.setdefault(buf.nbytes, []).append(buf)
                self.held += buf.nbytes


class EntryAssembler:
    """Cuts the data chunks of a stream into the entries its header declares.

    An entry's buffer (:func:`entry_buffer`, or one of ``pool``'s) is reserved when its first bytes
    arrive and filled as they come, so memory follows the bytes actually received, never a size a
    header declares, and a complete entry needs no second copy."""

    def __init__(self, sizes: list[int], pool: BufferPool | None = None) -> None:
        self.sizes = sizes
        self.pool = pool
        self.index = 0
        self._buf: np.ndarray | None = None
        self._filled = 0
        self.received = 0

    @property
    def done(self) -> bool:
        return self.index >= len(self.sizes)

    def feed(self, data: memoryview) -> list[tuple[int, memoryview]]:
        """Take one chunk; returns the entries it completed, as (index, payload)."""
        out = []
        while data.nbytes:
            space = self.space()
            take = min(space.nbytes, data.nbytes)
            space[:take] = data[:take]
            data = data[take:]
            out += self.advance(take)
        return out + self.advance(0)

    def space(self) -> memoryview:
        """Where the stream's next bytes go: the unfilled rest of the current entry's buffer, taken
        now (a receiver that reads straight into it saves a copy; then :meth:`advance`)."""
        if self.done:
            raise StreamOverrun("the stream carries more bytes than its header declares")
        if self._buf is None:
            size = self.sizes[self.index]
            self._buf = entry_buffer(size) if self.pool is None else self.pool.take(size)
        return memoryview(self._buf)[self._filled :]

    def advance(self, n: int) -> list[tuple[int, memoryview]]:
        """``n`` bytes were written at :meth:`space`; returns the entries now complete."""
        out = []
        self.received += n
        if n:
            self._filled += n
            if self._filled == self.sizes[self.index]:
                out.append((self.index, memoryview(self._buf)))
                self._buf, self._filled = None, 0
                self.index += 1
        # Zero-byte entries complete without data.
        while not self.done and self.sizes[self.index] == 0:
            out.append((self.index, memoryview(b"")))
            self.index += 1
        return out

    def discard(self) -> None:
        """Drop the bytes of an entry still incomplete."""
        self._buf, self._filled = None, 0

    def finish(self) -> list[tuple[int, memoryview]]:
        """Entries of zero bytes left at the end; StreamOverrun-free check that all are complete."""
        return self.feed(memoryview(b""))
