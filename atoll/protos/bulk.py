"""The bulk port: pushes and pulls as plain TCP streams, the tensors' bytes never cut into messages.

gRPC moves a 475 MiB push at 0.6-0.9 GB/s on a 2-core machine: every 1 MiB message is copied by
the serializer, by gRPC core into its slices, and out of them again into a Python bytes, each copy
holding a core that the islands' own work needs. On the bulk port the bytes go from the sender's
tensor into the kernel and from the kernel into the receiver's entry buffer, nothing in between.
The control RPCs (Join, Heartbeat, Leave) stay on gRPC; the coordinator advertises its bulk port in
``JoinResponse.bulk_port``, and an island that cannot reach it pushes and pulls over gRPC as before.
A coordinator serving gRPC over TLS serves the bulk port over TLS too, with the same certificate, key
and client CA (mutual TLS); a TLS island connects to it with the same trust and identity.

A call opens with a preamble::

    b"ATB1"  u8 method (1 push, 2 pull; | 0x80: keep; | 0x40: eager)  u16 length + auth  u32 length + message

A call without the ``KEEP`` bit is the connection's only one. With it (the coordinator's Join says it
keeps connections: ``bulk_keep_seconds``), a call that ends cleanly leaves its connections open for
the island's next call, which sends its preamble on them: no TCP or TLS handshake again, and where
the hosts allow it (``net.ipv4.tcp_slow_start_after_idle=0``) no slow start either. A push's data then
ends at its declared length, as over TLS. A refused, broken or abandoned call closes its connections;
so does the coordinator when a kept connection has been idle for ``bulk_keep_seconds`` or when half
its connection cap is in use.

A push with the ``EAGER`` bit sends its data right behind its preamble instead of waiting a round
trip for ``CONTINUE`` (an island's first attempt of a push: nothing of it can be held yet). The
coordinator then sends no ``CONTINUE``; whatever of the push it held from a cut attempt is dropped
(the data starts at its first byte). If it refuses the push at its header, or answers it there (a
duplicate), it sends the answer, stops writing and reads the data that was already on its way into
nothing until the island, which stops sending once it sees the answer, closes: a refused eager push
costs the link what is in flight for a round trip, and an admitted one saves that round trip.

``auth`` is the ``authorization`` metadata value gRPC would carry (``Bearer <token>``, or empty);
``message`` is a serialised ``PushChunk`` holding the push's header, or a ``PullRequest``. The
server answers with frames ``u8 kind  u32 length + bytes``:

- ``CONTINUE`` (push): the push is admitted for its whole declared size; the client now sends the
  header's entries' payloads, concatenated, exactly the bytes they declare (when the frame holds a
  u64 offset, the push resumes one that was cut: the client sends from that byte on), then ends
  its side of the connection (in the clear: a half-close, which also shows a stream carrying more
  than it declared; over TLS the declared length ends the data, as a half-close would end TLS).
- ``OK``: the call's answer: a ``PushResponse``, or a pull's ``UpdateHeader`` followed by its
  entries' payloads, concatenated, exactly the bytes the header declares; after those, when the
  header is ``tentative``, one more ``OK`` frame holding a ``Durable`` once the round is saved (or a
  ``STATUS`` if it was not in time).
- ``STATUS``: a refusal, a serialised ``google.rpc.Status`` (the code, message and atoll reason
  gRPC would carry): the client raises it as a :class:`BulkError`, a ``grpc.RpcError``, so
  retries and :func:`~atoll.protos.status.reason_of` treat both transports alike.

A stream that ends before its declared bytes, on either side, is a broken call.
"""

from __future__ import annotations

import collections
import socket
import struct
from collections.abc import Callable

import grpc
from google.rpc import status_pb2

MAGIC = b"ATB1"
PUSH, PULL, SIDE, PUSH_STRIPED, PULL_STRIPED = 1, 2, 3, 4, 5
STRIPED = {PUSH_STRIPED: PUSH, PULL_STRIPED: PULL}
OK, CONTINUE, STATUS = 0, 1, 2
MAX_AUTH_BYTES = 4096
PREAMBLE = struct.Struct("!4sBH")  # magic, method, auth length
LENGTH = struct.Struct("!I")
FRAME = struct.Struct("!BI")  # kind, length
STATUS_DETAILS_KEY = "grpc-status-details-bin"
STRIPE = struct.Struct("!16sBB")  # call id, this connection's index, the call's connection count
OFFSET = struct.Struct("!Q")  # a resumed push's CONTINUE: the bytes the coordinator holds already
UNIT = struct.Struct("!QI")  # a striped call's unit: its offset in the data, its length
END = 2**64 - 1
"""A unit offset that ends a connection's units (length 0)."""
UNIT_BYTES = 1 << 20
"""The most bytes one unit of a striped call carries."""
WINDOW_BYTES = 32 << 20
"""A sender starts a unit only below the lowest offset it is still writing plus this."""
AHEAD_BYTES = 64 << 20
"""A receiver reads a unit only below the offset it has everything before plus this (the rest wait in
their connections: memory stays bounded whatever a sender does)."""
MAX_STREAMS = 16
"""The most connections one call may be striped over."""
KEEP = 0x80
"""A preamble's method bit: keep the connection open for the next call once this one ends cleanly."""
EAGER = 0x40
"""A preamble's method bit (a push's): its data follows the preamble at once, no CONTINUE is awaited."""
KEEP_SECONDS = 300
"""How long the coordinator keeps an idle connection (an island drops its own a little before)."""


class UnitQueue:
    """A striped sender's units: those queued and those its connections are writing. Its owner guards
    it with its own lock (the coordinator's asyncio condition, an island's threading one)."""

    def __init__(self, connections: int) -> None:
        self.depth = 2 * connections
        self.queued: collections.deque = collections.deque()
        self.writing: set[int] = set()
        self.closing = False
        """No more units come: each connection ends its units once the queue is empty."""

    def has_room(self) -> bool:
        return len(self.queued) < self.depth

    def ready(self) -> bool:
        """A connection may act: take the next unit (not ``WINDOW_BYTES`` or more past the lowest one
        still being written, so a receiver never holds much out of order), or end its units."""
        if not self.queued:
            return self.closing
        offset = self.queued[0][0]
        return offset < min(self.writing, default=offset) + WINDOW_BYTES

    def take(self) -> tuple[int, memoryview] | None:
        """The next unit (its offset now being written), or None: no more."""
        if not self.queued:
            return None
        offset, unit = self.queued.popleft()
        self.writing.add(offset)
        return offset, unit

    def written(self, offset: int) -> None:
        self.writing.discard(offset)


def cut_units(start: int, data):
    """``data`` (the bytes from offset ``start`` of a call's data) as units: (offset, slice) in order."""
    view = memoryview(data).cast("B")
    for pos in range(0, view.nbytes, UNIT_BYTES):
        yield start + pos, view[pos : pos + UNIT_BYTES]


def preamble(method: int, auth: str, message: bytes) -> bytes:
    token = auth.encode()
    if len(token) > MAX_AUTH_BYTES:
        raise ValueError(f"authorization of {len(token)} bytes; the bulk port takes at most {MAX_AUTH_BYTES}")
    return PREAMBLE.pack(MAGIC, method, len(token)) + token + LENGTH.pack(len(message)) + message


def frame(kind: int, payload: bytes = b"") -> bytes:
    return FRAME.pack(kind, len(payload)) + payload


def status_frame(status: grpc.Status) -> bytes:
    """A refusal (what the servicer passed to ``abort_with_status``) as a STATUS frame."""
    for key, value in status.trailing_metadata or ():
        if key == STATUS_DETAILS_KEY:
            return frame(STATUS, value)
    return frame(STATUS, status_pb2.Status(code=status.code.value[0], message=status.details).SerializeToString())


class BulkError(grpc.RpcError):
    """A call on the bulk port that failed, shaped like gRPC's errors (``code``, ``details``,
    ``trailing_metadata``)."""

    def __init__(self, code: grpc.StatusCode, message: str, details_bin: bytes | None = None) -> None:
        super().__init__(f"{code.name}: {message}")
        self._code, self._message = code, message
        self._trailing = ((STATUS_DETAILS_KEY, details_bin),) if details_bin is not None else ()

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._message

    def trailing_metadata(self):
        return self._trailing

    @classmethod
    def from_status(cls, data: bytes) -> BulkError:
        status = status_pb2.Status.FromString(data)
        code = next((c for c in grpc.StatusCode if c.value[0] == status.code), grpc.StatusCode.UNKNOWN)
        return cls(code, status.message, data)


def broken(what: str) -> BulkError:
    """The connection failed or ended early: retryable, like a gRPC stream that broke."""
    return BulkError(grpc.StatusCode.UNAVAILABLE, f"bulk port: {what}")


def recv_into(sock: socket.socket, view: memoryview, progress: Callable[[int], None] | None = None) -> None:
    """Fill ``view`` from ``sock`` (blocking, each wait bounded by the socket's timeout); ``progress(n)``
    after each ``n`` bytes that came (what a broken call had, to resume from)."""
    got, total = 0, view.nbytes
    try:
        while got < total:
            n = sock.recv_into(view[got:])
            if n == 0:
                raise broken(f"the connection ended {total - got} bytes short")
            got += n
            if progress is not None:
                progress(n)
    except OSError as err:  # TimeoutError is one
        raise broken(f"{type(err).__name__}: {err}") from None


def recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    recv_into(sock, memoryview(buf))
    return bytes(buf)


def read_frame(sock: socket.socket, max_bytes: int) -> tuple[int, bytes]:
    kind, length = FRAME.unpack(recv_exact(sock, FRAME.size))
    if kind not in (OK, CONTINUE, STATUS) or length > max_bytes:
        raise broken(f"unexpected frame (kind {kind}, {length} bytes)")
    return kind, recv_exact(sock, length)
