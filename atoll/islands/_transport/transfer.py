"""The one writer of a push and the one reader of a pull, whatever carries the bytes
(:mod:`atoll.islands._transport.streams`: gRPC or the bulk port).

A push's payloads are a list, or ``encode(i)`` giving entry i's: then each entry is encoded on the
calling thread while the stream sends the previous one (two held at most), and an attempt that is
retried encodes again, so ``encode`` must give the same bytes each time.

A pull's entries are read one at a time into reused buffers and handed to ``on_entry`` as each is in
(one held at a time), or kept and returned. Once an entry was handed over the update cannot be taken
back, so a stream that breaks after that raises :class:`~atoll.islands.errors.PartialUpdate` (the
island then pulls the full θ); one that breaks before, or a tentative update whose confirmation never
comes, is a broken call like any other, and is retried.
"""

from __future__ import annotations

from collections.abc import Callable

import grpc

from atoll.islands._transport.streams import PullStream, PushStream
from atoll.islands.errors import PartialUpdate, ProtocolError
from atoll.protos import coordinator_pb2 as pb
from atoll.protos.rpc import BufferPool, entry_buffer

OnEntry = Callable[[pb.UpdateHeader, int, memoryview], None]
RESUMES = 8
"""How many times one pull asks for the rest of its answer before it gives up (a PartialUpdate then)."""


def broke(err: grpc.RpcError) -> bool:
    """The stream broke (UNAVAILABLE), as opposed to a refusal: what a resumable pull resumes from."""
    return err.code() == grpc.StatusCode.UNAVAILABLE if hasattr(err, "code") else False


def encoded(header: pb.PushHeader, encode: Callable[[int], object], i: int):
    """Entry i's payload from ``encode``, of the size the header declares (ProtocolError if not)."""
    payload, entry = encode(i), header.entries[i]
    if len(payload) != entry.num_bytes:
        raise ProtocolError(f"entry {entry.name}: {len(payload)} bytes encoded, header declares {entry.num_bytes}")
    return payload


def write_push(stream: PushStream, header: pb.PushHeader, payloads) -> pb.PushResponse:
    """Send a push's payloads on ``stream`` (its header went when it opened) and return the answer.
    ``payloads``: the entries' payloads (or any bytes-like pieces adding up to them), or ``encode(i)``."""
    pieces = payloads
    if callable(payloads):
        pieces = (encoded(header, payloads, i) for i in range(len(header.entries)))  # made as they go
    try:
        for payload in pieces:
            if not stream.send(payload):
                break  # answered part way: a duplicate, a closed round, or a refusal
            del payload
    except BaseException:
        stream.abort()
        raise
    return stream.finish()


def same_answer(a: pb.UpdateHeader, b: pb.UpdateHeader) -> bool:
    """Whether two headers announce the same answer (a resumed pull's must be the one it had; whether
    it is still tentative may differ)."""
    return (a.kind, a.round, a.codec, list(a.entries)) == (b.kind, b.round, b.codec, list(b.entries))


def read_update(
    stream: PullStream,
    on_entry: OnEntry | None,
    pool: BufferPool,
    confirm_wait: float,
    reopen: Callable[[int], PullStream] | None = None,
) -> tuple[pb.UpdateHeader, list, int]:
    """Read a pull's answer from ``stream``: (header, payloads, received bytes). With ``on_entry(header,
    i, payload)`` each entry is handed over as soon as its bytes are in (the payloads list is then
    empty) and its buffer goes back to ``pool``; the payload must not be kept once it returns.
    ``confirm_wait``: how long a tentative update's confirmation may take after its entries.
    ``reopen(offset)``: a stream of the rest of the same answer from ``offset`` of its data (the bulk
    port), asked for when a resumable stream breaks part way, at most ``RESUMES`` times; its header
    must be the one the pull had."""
    handed, payloads, received, resumes = 0, [], 0, 0
    try:
        header = stream.header()
        for i, entry in enumerate(header.entries):
            buf = pool.take(entry.num_bytes) if on_entry is not None else entry_buffer(entry.num_bytes)
            payload = memoryview(buf)
            while True:
                try:
                    resumable = getattr(stream, "resumable", False)
                    stream.read_into(payload[stream.delivered - received :] if resumable else payload)
                    break
                except grpc.RpcError as err:
                    if reopen is None or not resumable or resumes >= RESUMES or not broke(err):
                        raise
                    resumes += 1
                    offset = stream.delivered
                    stream.close()
                    stream = reopen(offset)
                    again = stream.header()
                    if not same_answer(again, header):
                        raise err from None
                    header = again  # (the round may have been saved meanwhile: no longer tentative)
            received += entry.num_bytes
            if on_entry is None:
                payloads.append(payload)
                continue
            on_entry(header, i, payload)  # applied: the payload is read no more
            handed += 1
            pool.give(payload)
        if header.tentative:  # installed only once its round is saved
            durable = stream.confirmation(confirm_wait)
            if durable.round != header.round:
                raise ProtocolError(f"confirmation of round {durable.round} for an update of round {header.round}")
        stream.end()
    except grpc.RpcError as err:
        if handed:
            raise PartialUpdate(f"the update stream broke after {handed} entries: {err.details()}") from err
        raise
    finally:
        stream.close()
    return header, payloads, received
