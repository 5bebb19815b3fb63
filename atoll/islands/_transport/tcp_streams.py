"""The island's side of the coordinator's bulk port (:mod:`atoll.protos.bulk`): a push or a pull on TCP
connections (kept from call to call, striped over several), with the same interface as the gRPC
streams (:mod:`atoll.islands._transport.streams`), so the one writer and the one reader never know which
carries the bytes."""

from __future__ import annotations

import contextlib
import queue
import socket
import ssl
import threading

import grpc

from atoll.islands._transport.kept import KeptConnections, peer_spoke
from atoll.islands._transport.opening import BulkPort, open_call
from atoll.islands._transport.streams import End
from atoll.islands._transport.striping import UnitReceiver, UnitSender
from atoll.protos import bulk
from atoll.protos import coordinator_pb2 as pb
from atoll.protos.rpc import MAX_MESSAGE_BYTES

EARLY_ANSWER_SECONDS = 1.0
"""How long an eager push whose payloads fell short of its header waits for the coordinator's refusal
of the header before it says the shortfall instead."""


def _answer(sock: socket.socket, *, continuing: bool = False) -> bytes | None:
    """The server's answer: its OK message, None for CONTINUE (when ``continuing``), or raise its refusal."""
    kind, data = bulk.read_frame(sock, MAX_MESSAGE_BYTES)
    if kind == bulk.STATUS:
        raise bulk.BulkError.from_status(data)
    if kind == bulk.CONTINUE and continuing:
        return None
    if kind != bulk.OK:
        raise bulk.broken(f"unexpected frame kind {kind}")
    return data


def _mismatch(what: str) -> bulk.BulkError:
    """A push whose payloads do not add up to its header, refused before the coordinator could count it
    (the same code the coordinator gives where it can see it: in the clear on one connection not kept)."""
    return bulk.BulkError(grpc.StatusCode.INVALID_ARGUMENT, f"bulk port: {what}")


class _TcpCall:
    """The connections of one call on the bulk port: opened, or taken from ``kept`` when the coordinator
    keeps them, and given back there only once the call has ended cleanly."""

    def __init__(
        self,
        port: BulkPort,
        method: int,
        auth: str,
        message: bytes,
        timeout: float,
        streams: int,
        kept: KeptConnections | None,
        eager: bool = False,
    ) -> None:
        self._port, self._kept = port, kept if port.keep_seconds > 0 else None
        self._socks, self.rtt = open_call(port, method, auth, message, timeout, streams, self._kept, eager)
        self._sock = self._socks[0]

    def _given_back(self, clean: bool) -> bool:
        """Give the connections back for the next call when ``clean`` and kept; whether they were."""
        if clean and self._kept is not None:
            self._kept.give(self._port, self._socks)
            return True
        return False


class TcpPush(_TcpCall):
    """A push on the bulk port: the header in the preamble; the data goes once it is admitted (CONTINUE),
    or at once when ``eager`` (``bulk.EAGER``: a first attempt, of which the coordinator can hold
    nothing; a round trip sooner, and the answer, a refusal included, is read at the end), sent from
    the payloads' own memory by a sender thread while the caller makes the next one; the end of the
    data is the client's half-close (in the clear, one connection, not kept) or its declared length.
    Striped over ``streams`` connections, the sender deals the data's units to one thread each. With
    ``kept``, connections come from there and go back once the call has ended cleanly."""

    def __init__(
        self,
        port: BulkPort,
        header: pb.PushHeader,
        *,
        auth: str,
        timeout: float,
        streams: int = 1,
        kept: KeptConnections | None = None,
        eager: bool = False,
    ) -> None:
        message = pb.PushChunk(header=header).SerializeToString()
        super().__init__(port, bulk.PUSH, auth, message, timeout, streams, kept, eager)
        self._eager = eager
        self._declared, self._given = sum(e.num_bytes for e in header.entries), 0
        self._delimited = len(self._socks) > 1 or isinstance(self._sock, ssl.SSLSocket) or self._kept is not None
        """The declared length ends the data (TLS, striped or kept): the coordinator cannot see a short or
        long one, so this side refuses to send it."""
        self._ready: queue.Queue = queue.Queue(maxsize=1)
        self._failed: list[BaseException | None] = []
        self._early: bytes | None = None
        self.resumed_from = 0
        """Bytes the coordinator held from an attempt that was cut (they are not sent again)."""
        if not eager:  # (an eager push's answer, a refusal included, is read at the end)
            try:
                self._admitted()
            except BaseException:
                self._close()
                raise
        self._sender = None
        if self._early is None:
            self._sender = threading.Thread(target=self._send_all, name="atoll-bulk-send", daemon=True)
            self._sender.start()

    def _admitted(self) -> None:
        """Wait for the coordinator's answer to the header: CONTINUE (with the offset a cut attempt
        resumes from), an answer with nothing to send, or a refusal (raised)."""
        kind, data = bulk.read_frame(self._sock, MAX_MESSAGE_BYTES)
        if kind == bulk.STATUS:
            raise bulk.BulkError.from_status(data)
        if kind == bulk.OK:
            self._early = data  # answered at the header: nothing to send
        elif kind != bulk.CONTINUE or len(data) not in (0, bulk.OFFSET.size):
            raise bulk.broken(f"unexpected frame kind {kind}")
        elif data:
            (self.resumed_from,) = bulk.OFFSET.unpack(data)

    def _sendall(self, sock: socket.socket, data) -> None:
        try:
            sock.sendall(data)
        except OSError as err:
            self._failed.append(bulk.broken(f"{type(err).__name__}: {err}"))

    def _send_all(self) -> None:
        units = UnitSender(self._socks, self._failed, lambda: peer_spoke(self._sock)) if len(self._socks) > 1 else None
        start = 0
        while (payload := self._ready.get()) is not End:
            view = memoryview(payload).cast("B")
            end, skip = start + view.nbytes, max(self.resumed_from - start, 0)  # what the coordinator holds
            if skip < view.nbytes:
                view, start = view[skip:], start + skip
                if units is not None:
                    for offset, unit in bulk.cut_units(start, view):
                        if not units.put(offset, unit):
                            break
                else:
                    if not self._failed and peer_spoke(self._sock):
                        self._failed.append(None)  # refused part way: the answer is read by finish()
                    if not self._failed:
                        self._sendall(self._sock, view)
            start = end
            del payload, view
        if units is not None:
            units.close()

    def send(self, payload) -> bool:
        if self._sender is None or self._failed:
            return False
        self._given += memoryview(payload).nbytes
        if self._delimited and self._given > self._declared:
            raise _mismatch(f"the payloads carry more bytes than the header declares ({self._declared})")
        self._ready.put(payload)
        return True

    def sent_so_far(self) -> list[socket.socket]:
        """Wait until every byte given so far is on the wire and return the call's connections, the call
        left unfinished (the harness ends them as a dying link would: :mod:`atoll.harness.transfers`)."""
        if self._sender is not None:
            self._ready.put(End)
            self._sender.join()
        return list(self._socks)

    def finish(self) -> pb.PushResponse:
        if self._sender is not None and self._delimited and self._given < self._declared and not self._failed:
            refusal = self._refusal_at_header() if self._eager else None
            self.abort()
            raise refusal or _mismatch(f"the push's data ended early: {self._given} of {self._declared} bytes declared")
        clean = False
        try:
            if self._sender is None:
                response = pb.PushResponse.FromString(self._early)  # answered at the header: nothing to send
                clean = True
                return response
            self._ready.put(End)
            self._sender.join()
            if not self._failed:
                if len(self._socks) == 1 and not isinstance(self._sock, ssl.SSLSocket) and self._kept is None:
                    with contextlib.suppress(OSError):  # (over TLS, striped or kept, the declared length ends it)
                        self._sock.shutdown(socket.SHUT_WR)  # the end of the data
            elif self._failed[0] is not None and not peer_spoke(self._sock):
                raise self._failed[0]  # the wire broke and no answer waits
            # The answer, or the refusal part way (the server stopped reading).
            response = pb.PushResponse.FromString(_answer(self._sock))
            clean = not self._failed  # every byte sent and answered: the connections carry nothing more
            return response
        finally:
            self._close(clean)

    def _refusal_at_header(self) -> bulk.BulkError | None:
        """An eager push whose data fell short: the coordinator's refusal of its header, if one comes
        within ``EARLY_ANSWER_SECONDS`` (its reason says more than the short data: it is what a push
        that waited for admission would have been told)."""
        self._ready.put(End)
        self._sender.join()
        if (self._failed and self._failed[0] is not None) or not peer_spoke(self._sock, EARLY_ANSWER_SECONDS):
            return None
        try:
            kind, data = bulk.read_frame(self._sock, MAX_MESSAGE_BYTES)
        except (OSError, grpc.RpcError):
            return None
        return bulk.BulkError.from_status(data) if kind == bulk.STATUS else None

    def _close(self, clean: bool = False) -> None:
        if self._given_back(clean):
            return
        for sock in self._socks:
            sock.close()

    def abort(self) -> None:
        for sock in self._socks:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)  # a sender blocked on the wire gives up now
        if self._sender is not None:
            self._ready.put(End)
            self._sender.join()
        self._close()


class TcpPull(_TcpCall):
    """A pull on the bulk port: the header frame, the entries' payloads read straight into the caller's
    buffers (striped: each unit from its connection, in order), then (tentative) the Durable frame.
    With ``kept``, connections come from there and go back once the whole answer was read."""

    def __init__(
        self,
        port: BulkPort,
        req: pb.PullRequest,
        *,
        auth: str,
        timeout: float,
        streams: int = 1,
        kept: KeptConnections | None = None,
    ) -> None:
        self._timeout = timeout
        self._clean = False
        super().__init__(port, bulk.PULL, auth, req.SerializeToString(), timeout + req.wait_seconds, streams, kept)
        self._units: UnitReceiver | None = None
        self._delivered = req.resume_offset

    resumable = True
    """A pull that breaks part way may ask for the rest of its answer (``PullRequest.resume_offset``)."""

    @property
    def delivered(self) -> int:
        """The offset in the answer's data up to which the caller has its bytes."""
        return self._units.frontier if self._units is not None else self._delivered

    def header(self) -> pb.UpdateHeader:
        header = pb.UpdateHeader.FromString(_answer(self._sock))
        for sock in self._socks:
            sock.settimeout(self._timeout)
        if len(self._socks) > 1:
            self._units = UnitReceiver(self._socks, start=self._delivered)
        return header

    def read_into(self, view: memoryview) -> None:
        if self._units is not None:
            self._units.read_into(view)
            return
        bulk.recv_into(self._sock, view, self._came)

    def _came(self, n: int) -> None:
        self._delivered += n

    def confirmation(self, wait: float = 0.0) -> pb.Durable:
        if self._units is not None:
            self._units.join_lead()  # past the lead's units
        self._sock.settimeout(self._timeout + wait)
        return pb.Durable.FromString(_answer(self._sock))

    def end(self) -> None:
        """The call ends with the header's entries (the server closes the connections, or, kept, waits
        on them for the next call once each has ended its units)."""
        self._clean = self._units is None or self._units.settle(self._timeout)

    def close(self) -> None:
        if self._given_back(self._clean):
            return
        if self._units is not None:
            self._units.close()
        for sock in self._socks:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)  # its readers give up now
            sock.close()
