"""A bulk-port call as the servicer reads it, so that gRPC and the bulk port share one servicer: its
context (the caller's token, and how to refuse), and a push's data read straight into its entries."""

from __future__ import annotations

from atoll.coordinator.transport.connection import Connection
from atoll.coordinator.transport.striped import Striped
from atoll.protos import bulk
from atoll.protos.rpc import StreamOverrun


class Aborted(Exception):
    """The servicer refused the call (its ``abort_with_status``)."""

    def __init__(self, status) -> None:
        super().__init__(status.details)
        self.status = status


class Context:
    """What the servicer reads of a gRPC context: the caller's metadata, and how to refuse."""

    def __init__(self, auth: str) -> None:
        self._metadata = (("authorization", auth),) if auth else ()

    def invocation_metadata(self):
        return self._metadata

    async def abort_with_status(self, status):
        raise Aborted(status)


class BulkPush:
    """A push on the bulk port as the servicer reads it: its header as the first message, then
    :meth:`fill`, which admits the data and reads it into the entries. The answers go on ``conn``, the
    data comes on ``data`` (the same connection, or the call's stripes)."""

    resumable = True
    """A push cut part way is parked for its retry, which sends only what the coordinator lacks."""
    cut = False
    """The data ended without the client ending it (a reset, or the end of a TLS or striped stream)."""
    read = False
    """:meth:`fill` was called: the data was (or was being) read. An eager push answered without it has
    its data on the way unread."""

    def __init__(self, conn: Connection, first, data: Connection | Striped | None = None, eager: bool = False) -> None:
        self.conn = conn
        self.data = conn if data is None else data
        self._first = first
        self.eager = eager
        """The client sends the data from its first byte without waiting for CONTINUE (``bulk.EAGER``):
        nothing parked from a cut attempt is taken, and no CONTINUE is said."""

    def __aiter__(self):
        return self

    async def __anext__(self):
        if self._first is None:
            raise StopAsyncIteration
        first, self._first = self._first, None
        return first

    async def fill(self, assembler, taken) -> None:
        """Say CONTINUE, then read the data into ``assembler``'s entries until the client ends its
        side, handing each completed batch to ``taken`` (async). Fewer bytes than declared return
        early (the servicer refuses the push); more raise StreamOverrun."""
        conn, data = self.conn, self.data
        self.read = True
        start = assembler.received  # a resumed push's: what came before it broke
        if self.eager and start:
            raise ValueError("an eager push resumed from a parked one")  # (the servicer drops those)
        if isinstance(data, Striped):
            data.bound(sum(assembler.sizes))  # (no unit held outside the declared, reserved bytes)
            if start:
                data.begin(start)
        if not self.eager:  # (an eager client is sending already)
            await conn.send(bulk.frame(bulk.CONTINUE, bulk.OFFSET.pack(start) if start else b""))
        if isinstance(data, Striped):
            data.receive()  # (read to each connection's END even if no unit comes: a kept one is reused)
        conn.expect()
        done = assembler.advance(0)  # leading zero-byte entries
        try:
            while True:
                if done:
                    conn.expect(False)  # validating what arrived is not the peer's idleness
                    await taken(done)
                    conn.expect()
                if assembler.done:
                    break
                done = assembler.advance(await data.recv_into(assembler.space()))
            if data.delimited:
                return  # over TLS, or striped, the declared length ends the data (what follows is never read)
            await conn.recv_into(memoryview(bytearray(1)))
        except EOFError:  # in the clear the client's half-close (kept or not); else a cut (it would have sent it all)
            self.cut = type(data).delimited
            return
        raise StreamOverrun("the stream carries more bytes than its header declares")
