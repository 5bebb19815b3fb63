"""An island's calls on the coordinator's bulk port (:mod:`atoll.protos.bulk`): one push or pull per
TCP connection, the payloads sent from their own memory and read straight into entry buffers.

Failures are ``grpc.RpcError``\\ s (:class:`~atoll.protos.bulk.BulkError`) with the codes gRPC would
give, so :class:`~atoll.islands.client.CoordinatorClient` retries both transports alike; a port
that cannot be reached at all raises :class:`BulkUnreachable` instead, and the client goes back
to gRPC.
"""

from __future__ import annotations

import contextlib
import queue
import select
import socket
import threading
from collections.abc import Callable, Iterable

from atoll.islands.errors import ProtocolError
from atoll.protos import bulk
from atoll.protos import coordinator_pb2 as pb
from atoll.protos.rpc import DURABLE_WAIT_SECONDS, MAX_MESSAGE_BYTES, BufferPool, entry_buffer

CONNECT_SECONDS = 10.0


class BulkUnreachable(ConnectionError):
    """The bulk port refused or did not answer the connection."""


class BulkClient:
    def __init__(self, host: str, port: int, *, auth: str, timeout: float) -> None:
        """``timeout``: the longest wait for any one step of a call (a pull adds its long-poll wait)."""
        self.host, self.port = host, port
        self.auth = auth
        self.timeout = timeout

    @property
    def address(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"

    def _open(self, method: int, message: bytes) -> socket.socket:
        try:
            sock = socket.create_connection((self.host, self.port), timeout=CONNECT_SECONDS)
        except OSError as err:
            raise BulkUnreachable(f"bulk port {self.address}: {err}") from None
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.settimeout(self.timeout)
            sock.sendall(bulk.preamble(method, self.auth, message))
        except OSError as err:
            sock.close()
            raise bulk.broken(f"{type(err).__name__}: {err}") from None
        return sock

    @staticmethod
    def _answer(sock: socket.socket, *, continuing: bool = False) -> bytes | None:
        """The server's answer: its OK message, None for CONTINUE (when ``continuing``), or raise its
        refusal."""
        kind, data = bulk.read_frame(sock, MAX_MESSAGE_BYTES)
        if kind == bulk.STATUS:
            raise bulk.BulkError.from_status(data)
        if kind == bulk.CONTINUE and continuing:
            return None
        if kind != bulk.OK:
            raise bulk.broken(f"unexpected frame kind {kind}")
        return data

    def push(self, header: pb.PushHeader, payloads: Callable[[int], object] | Iterable) -> pb.PushResponse:
        """One attempt at a push: ``payloads`` is the header's entries' payloads in order (any
        bytes-like pieces adding up to them), or ``encode(i)`` giving entry i's, which is then encoded
        on this thread while the previous entry is sent by another (two held at most)."""
        sock = self._open(bulk.PUSH, pb.PushChunk(header=header).SerializeToString())
        try:
            answer = self._answer(sock, continuing=True)
            if answer is None:  # admitted: the data
                try:
                    if callable(payloads):
                        _send_encoded(sock, header, payloads)
                    else:
                        for piece in payloads:
                            if _answered(sock):
                                break
                            _sendall(sock, piece)
                    sock.shutdown(socket.SHUT_WR)  # the end of the data
                except OSError as err:
                    if not _answered(sock):
                        raise bulk.broken(f"{type(err).__name__}: {err}") from None
                except bulk.BulkError:
                    if not _answered(sock):
                        raise
                answer = self._answer(sock)  # the server's answer, or its refusal part way (it stops reading)
            return pb.PushResponse.FromString(answer)
        finally:
            sock.close()

    def pull(self, req: pb.PullRequest, on_entry, pool: BufferPool) -> tuple[pb.UpdateHeader, list, int]:
        """One attempt at a pull: (header, payloads, received bytes). With ``on_entry(header, i,
        payload)`` each entry is handed over once its bytes are in (payloads is then empty) and its
        buffer goes back to ``pool``; an error after the first such entry raises it with
        ``handed`` set on it (the caller cannot retry a half-applied update)."""
        sock = self._open(bulk.PULL, req.SerializeToString())
        handed, payloads = 0, []
        try:
            sock.settimeout(self.timeout + req.wait_seconds)
            header = pb.UpdateHeader.FromString(self._answer(sock))
            sock.settimeout(self.timeout)
            received = 0
            for i, entry in enumerate(header.entries):
                buf = pool.take(entry.num_bytes) if on_entry is not None else entry_buffer(entry.num_bytes)
                payload = memoryview(buf)
                bulk.recv_into(sock, payload)
                received += entry.num_bytes
                if on_entry is None:
                    payloads.append(payload)
                    continue
                on_entry(header, i, payload)
                handed += 1
                pool.give(payload)
            if header.tentative:  # installed only once the round is saved
                sock.settimeout(self.timeout + DURABLE_WAIT_SECONDS)
                durable = pb.Durable.FromString(self._answer(sock))
                if durable.round != header.round:
                    raise ProtocolError(f"confirmation of round {durable.round} for an update of round {header.round}")
            return header, payloads, received
        except bulk.BulkError as err:
            err.handed = handed
            raise
        finally:
            sock.close()


def encoded(header: pb.PushHeader, encode: Callable[[int], object], i: int):
    """Entry i's payload from ``encode``, of the size the header declares (ProtocolError if not)."""
    payload, entry = encode(i), header.entries[i]
    if len(payload) != entry.num_bytes:
        raise ProtocolError(f"entry {entry.name}: {len(payload)} bytes encoded, header declares {entry.num_bytes}")
    return payload


def _answered(sock: socket.socket) -> bool:
    """The server has answered already (a refusal part way through the data): stop sending."""
    poller = select.poll()  # not select(): descriptors past 1024
    poller.register(sock, select.POLLIN)
    return bool(poller.poll(0))


def _sendall(sock: socket.socket, data) -> None:
    try:
        sock.sendall(data)
    except OSError as err:
        raise bulk.broken(f"{type(err).__name__}: {err}") from None


def _send_encoded(sock: socket.socket, header: pb.PushHeader, encode: Callable[[int], object]) -> None:
    """Encode the entries on this thread while a sender thread puts the previous one on the wire."""
    ready: queue.Queue = queue.Queue(maxsize=1)  # with the one being sent: two entries held
    failed: list[BaseException | None] = []

    def send() -> None:
        while (payload := ready.get()) is not None:
            if not failed and _answered(sock):
                failed.append(None)  # refused part way: the answer is read after this
            if not failed:
                try:
                    _sendall(sock, payload)
                except BaseException as err:  # noqa: BLE001 - handed to the encoding thread
                    failed.append(err)
            del payload

    sender = threading.Thread(target=send, name="atoll-bulk-send", daemon=True)
    sender.start()
    try:
        for i in range(len(header.entries)):
            if failed:
                break  # the answer says why
            payload = encoded(header, encode, i)
            ready.put(payload)
            del payload
    except BaseException:
        with contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_RDWR)  # a sender blocked on the wire gives up now
        raise
    finally:
        ready.put(None)
        sender.join()
    if failed and failed[0] is not None:
        raise failed[0]
