"""The two byte sources of an island's transport: a push or a pull on gRPC, or on the coordinator's bulk
port (TCP connections kept from call to call, :mod:`atoll.protos.bulk`; those are
:mod:`atoll.islands._transport.tcp_streams`). Both give the same interface, defined here with the gRPC
ones, so the one writer and the one reader (:mod:`atoll.islands._transport.transfer`) never know which
carries the bytes.

- :class:`PushStream`: the header goes first when it opens (an admission or a refusal comes back
  before any data, on the bulk port); :meth:`~PushStream.send` hands over the next payload and returns
  at once while the previous one is on the wire (one held, one sending), and says False once the
  coordinator has answered part way (a refusal: stop sending); :meth:`~PushStream.finish` ends the data
  and returns the answer, or raises the refusal.
- :class:`PullStream`: :meth:`~PullStream.header`, then :meth:`~PullStream.read_into` the entries' data
  in order, then, for a tentative update, :meth:`~PullStream.confirmation`.

Failures are ``grpc.RpcError``\\ s on both (the bulk port's :class:`~atoll.protos.bulk.BulkError` has gRPC's
codes), so retries and reasons treat the transports alike; a bulk port that cannot be reached at all
raises :class:`~atoll.islands._transport.opening.BulkUnreachable`, and the client goes back to gRPC.
"""

from __future__ import annotations

import queue
from typing import Protocol

from atoll.islands.errors import ProtocolError
from atoll.protos import bulk
from atoll.protos import coordinator_pb2 as pb
from atoll.protos.raw import RawData
from atoll.protos.rpc import ChunkPacker


class PushStream(Protocol):
    def send(self, payload) -> bool: ...

    def finish(self) -> pb.PushResponse: ...

    def abort(self) -> None: ...


class PullStream(Protocol):
    def header(self) -> pb.UpdateHeader: ...

    def read_into(self, view: memoryview) -> None: ...

    def confirmation(self, wait: float = 0.0) -> pb.Durable: ...

    def end(self) -> None: ...

    def close(self) -> None: ...


# ---- gRPC ---------------------------------------------------------------------------------------
class End:
    """The request stream's end."""


class GrpcPush:
    """A push as one gRPC stream-unary call: its request stream (the header, then the payloads cut into
    chunks, small ones packed together) is read by gRPC's own thread from a one-deep queue."""

    def __init__(self, call, header: pb.PushHeader, *, timeout: float, metadata) -> None:
        self._ready: queue.Queue = queue.Queue(maxsize=1)
        self._call = call.future(self._messages(header), timeout=timeout, metadata=metadata)

    def _messages(self, header: pb.PushHeader):
        yield pb.PushChunk(header=header)
        packer = ChunkPacker()
        while (payload := self._ready.get()) is not End:
            yield from packer.add(payload)
            del payload
        yield from packer.flush()

    def send(self, payload) -> bool:
        while not self._call.done():
            try:
                self._ready.put(payload, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False  # answered before reading everything (a duplicate, a closed round, a refusal)

    def finish(self) -> pb.PushResponse:
        self._end()
        return self._call.result()

    def abort(self) -> None:
        self._call.cancel()
        self._end()

    def _end(self) -> None:
        while not self._call.done():  # the request stream ends once its reader takes this
            try:
                self._ready.put(End, timeout=0.1)
                return
            except queue.Full:
                continue


class GrpcPull:
    """A pull as one gRPC unary-stream call: the header message, data chunks, then (tentative) Durable."""

    resumable = False

    def __init__(self, call, req: pb.PullRequest, *, timeout: float, metadata) -> None:
        self._stream = call(req, timeout=timeout, metadata=metadata)
        self._chunk = memoryview(b"")

    def _next(self):
        try:
            return next(self._stream)
        except StopIteration:
            return None

    def header(self) -> pb.UpdateHeader:
        first = self._next()
        if first is None or isinstance(first, RawData) or first.WhichOneof("kind") != "header":
            raise ProtocolError("update stream without a header first")
        return first.header

    def read_into(self, view: memoryview) -> None:
        filled = 0
        while filled < view.nbytes:
            if not self._chunk.nbytes:
                msg = self._next()
                if msg is None:
                    raise bulk.broken("the update stream ended before its entries' bytes")
                if isinstance(msg, RawData):
                    self._chunk = msg.view
                elif msg.WhichOneof("kind") == "data":
                    self._chunk = memoryview(msg.data)
                else:
                    raise ProtocolError("an update stream's message in the middle of its data")
            take = min(self._chunk.nbytes, view.nbytes - filled)
            view[filled : filled + take] = self._chunk[:take]
            self._chunk, filled = self._chunk[take:], filled + take

    def confirmation(self, wait: float = 0.0) -> pb.Durable:
        msg = self._next()  # the call's own deadline allows for the wait
        if msg is None:
            raise bulk.broken("the update stream ended before its round was confirmed saved")
        if isinstance(msg, RawData) or msg.WhichOneof("kind") != "durable":
            raise ProtocolError("update stream data past its header's entries")
        return msg.durable

    def end(self) -> None:
        """The stream must end here (nothing past what the header declares)."""
        if self._chunk.nbytes or self._next() is not None:
            raise ProtocolError("update stream data past its header's entries")

    def close(self) -> None:
        self._stream.cancel()


# ---- the bulk port ------------------------------------------------------------------------------
