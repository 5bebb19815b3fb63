"""The coordinator's bulk port (:mod:`atoll.protos.bulk`): pushes and pulls over plain TCP.

Each call goes to the same servicer methods gRPC calls (``PushDelta``, ``PullUpdate``), so
admission, validation, identity checks, counters and refusals are the same code; only the bytes
move differently. A connection carries one call, or (an island that asks, ``bulk.KEEP``) one call
after another while each ends cleanly and the next comes within ``keep_seconds``. A push's payloads
are read by the event loop straight into their entry buffers (``sock_recv_into``, no copy but the
kernel's); a pull's are sent from the update's own memory (``sock_sendall``). No thread per
connection: a slow or silent peer holds a coroutine, and a watchdog ends a connection that makes no
progress for ``idle_seconds`` while it is expected to (a pull's long-poll wait is not idleness).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import socket
import ssl
import struct
import time

import grpc

from atoll.coordinator.transport.bulk_calls import Aborted, BulkPush, Context
from atoll.coordinator.transport.connection import Connection, TlsConnection
from atoll.coordinator.transport.counters import Resent
from atoll.coordinator.transport.security import UNAUTHENTICATED, IslandTokens
from atoll.coordinator.transport.service import tolerant
from atoll.coordinator.transport.striped import Striped, StripeSet
from atoll.errors import PortInUse
from atoll.protos import bulk
from atoll.protos import coordinator_pb2 as pb
from atoll.protos.raw import RawData, deserialize_push_chunk
from atoll.protos.reasons import Reason
from atoll.protos.rpc import MAX_MESSAGE_BYTES
from atoll.protos.status import error_status

log = logging.getLogger("atoll.coordinator")
DRAIN_SECONDS = 10.0
"""How long a refused call's late bytes are read and dropped before its connection is closed."""
PREAMBLE_SECONDS = 10.0
"""How long a new connection has to send its preamble (a client sends it at once)."""
MAX_CONNECTIONS = 1024
"""Connections served at once; more are closed as they come (each holds a descriptor)."""


class BulkServer:
    """Listens on ``host:port`` (0 picks one) and serves each connection's one call with ``servicer``;
    over TLS with ``tls`` (the context :meth:`TlsConfig.ssl_context` makes from gRPC's certificates)."""

    def __init__(
        self,
        servicer,
        *,
        host: str,
        port: int,
        tokens: IslandTokens | None,
        idle_seconds: float,
        tls: ssl.SSLContext | None = None,
        max_connections: int = MAX_CONNECTIONS,
        keep_seconds: float = bulk.KEEP_SECONDS,
    ) -> None:
        self.servicer = servicer
        self.tokens = tokens
        self.tls = tls
        self.idle_seconds = idle_seconds
        self.max_connections = max_connections
        self.keep_seconds = keep_seconds
        """How long a connection that asked to be kept waits for its next call (0: one call each)."""
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        try:
            self._sock = socket.create_server((host, port), family=family, backlog=256)
        except OSError as err:
            raise PortInUse(f"--bulk-port {port} on {host} cannot be bound: {err.strerror or err}") from None
        self._sock.setblocking(False)
        self.port: int = self._sock.getsockname()[1]
        self._accepting = False
        self._backoff: asyncio.TimerHandle | None = None
        """Accepting paused after a failed accept (out of descriptors): when it resumes."""
        self._calls: set[asyncio.Task] = set()
        self._stripes: dict[bytes, StripeSet] = {}
        """Striped calls whose connections are coming in, by call id."""

    @property
    def connections(self) -> int:
        """Connections accepted and not yet closed (the admin page and tests read it)."""
        return len(self._calls)

    async def start(self) -> None:
        asyncio.get_running_loop().add_reader(self._sock.fileno(), self._accept)
        self._accepting = True

    async def stop(self) -> None:
        loop = asyncio.get_running_loop()
        if self._accepting:
            loop.remove_reader(self._sock.fileno())
            self._accepting = False
        if self._backoff is not None:
            self._backoff.cancel()
        tasks = list(self._calls)
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        self._sock.close()

    def _accept(self) -> None:
        """The listening socket is readable: take every connection waiting, each to a call task at once
        (no future between a connection's accept and its task, where a stop would lose it open)."""
        while self._accepting:
            try:
                sock, _ = self._sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as err:  # out of descriptors, a connection reset before accept: try again soon
                log.warning("bulk port: accept failed: %s", err)
                self._pause_accepting(0.1)
                return
            if len(self._calls) >= self.max_connections:
                log.warning("bulk port: %d connections open; closing a new one", len(self._calls))
                self.servicer.counters.bulk_over_cap += 1
                sock.close()
                continue
            self.servicer.counters.bulk_connections += 1
            sock.setblocking(False)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn = Connection(sock) if self.tls is None else TlsConnection(sock, self.tls)
            task = asyncio.get_running_loop().create_task(self._serve(conn))
            self._calls.add(task)
            task.add_done_callback(functools.partial(self._ended, conn))

    def _ended(self, conn: Connection, task: asyncio.Task) -> None:
        """A call's task is done: its connection closes (here, so that one cancelled before its first step,
        by a stop, closes too)."""
        self._calls.discard(task)
        conn.sock.close()

    def _pause_accepting(self, seconds: float) -> None:
        loop = asyncio.get_running_loop()
        loop.remove_reader(self._sock.fileno())

        def resume() -> None:
            self._backoff = None
            if self._accepting:
                loop.add_reader(self._sock.fileno(), self._accept)

        self._backoff = loop.call_later(seconds, resume)

    async def _serve(self, conn: Connection) -> None:
        call = asyncio.current_task()
        watchdog = asyncio.create_task(self._watch(conn, call))
        first = True
        try:
            while await self._call(conn, first):
                first = False
        except Aborted as refusal:
            with contextlib.suppress(OSError):
                await conn.send(bulk.status_frame(refusal.status))
                await self._drain(conn)
        except (OSError, EOFError, ValueError, struct.error) as err:  # the peer went away, or sent no call
            # (an island measures its round trip with a connection that sends nothing, and closes a
            # kept one between calls: not news)
            quiet = not conn.received or conn.between_calls
            log.log(logging.DEBUG if quiet else logging.INFO, "bulk port: connection ended: %s", err)
        except asyncio.CancelledError:
            if not conn.timed_out:
                raise
            if conn.between_calls:  # a kept connection that no call came on for keep_seconds
                log.debug("bulk port: a kept connection idle for %gs; closed", self.keep_seconds)
                return
            log.info("bulk port: no progress for %gs; connection closed", conn.limit or self.idle_seconds)
            self.servicer.counters.bulk_timeouts += 1
        except Exception:  # a handler's failure ends its call (the client sees a broken stream), not the port
            log.exception("bulk port: a call failed")
        finally:
            watchdog.cancel()  # (the connection closes once this task is done: _ended)

    async def _drain(self, conn: Connection) -> None:
        """After a refusal: read what the peer still sends until it stops (it stops once it sees the
        answer), so that closing does not reset the connection and lose the answer before it is read;
        ``DRAIN_SECONDS`` at most. What it reads is an eager push's data, counted as sent for nothing."""
        conn.sock.shutdown(socket.SHUT_WR)
        scratch = memoryview(bytearray(1 << 16))
        counters = self.servicer.counters

        async def to_the_end() -> None:
            with contextlib.suppress(EOFError):
                while True:
                    counters.resent(Resent.PUSH_UNREAD, await conn.recv_into(scratch))

        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(to_the_end(), DRAIN_SECONDS)

    async def _watch(self, conn: Connection, call: asyncio.Task) -> None:
        while True:
            await asyncio.sleep(max(min(self.idle_seconds, PREAMBLE_SECONDS) / 4, 0.05))
            limit = self.idle_seconds if conn.limit is None else conn.limit
            if conn.since is not None and time.monotonic() - conn.since > limit:
                conn.timed_out = True
                call.cancel()
                return

    def _keeps(self, asked: bool) -> bool:
        """Whether a connection whose call asked to be kept stays open for another (not once half the
        cap is in use: idle connections must not crowd out calls)."""
        return asked and self.keep_seconds > 0 and len(self._calls) <= self.max_connections // 2

    async def _call(self, conn: Connection, first: bool = True) -> bool:
        """Serve the connection's next call; whether the connection stays open for another."""
        preamble_limit = min(PREAMBLE_SECONDS, self.idle_seconds)
        head = b""
        if first:
            conn.expect(limit=preamble_limit)
            await conn.start()
        else:  # a kept connection: its next call may be a round away
            conn.expect(limit=self.keep_seconds)
            conn.between_calls = True
            head = await conn.recv_exact(1)
            conn.between_calls = False
            conn.expect(limit=preamble_limit)
        raw = head + await conn.recv_exact(bulk.PREAMBLE.size - len(head))
        magic, method, auth_len = bulk.PREAMBLE.unpack(raw)
        keep = bool(method & bulk.KEEP) and self.keep_seconds > 0
        eager = bool(method & bulk.EAGER)
        method &= ~(bulk.KEEP | bulk.EAGER)
        if magic != bulk.MAGIC or not bulk.PUSH <= method <= bulk.PULL_STRIPED or auth_len > bulk.MAX_AUTH_BYTES:
            raise ValueError("not an atoll bulk call")
        if eager and method not in (bulk.PUSH, bulk.PUSH_STRIPED):
            raise ValueError("only a push's data comes eagerly")
        conn.delimited = keep or type(conn).delimited  # a kept connection's push data ends at its length
        auth = (await conn.recv_exact(auth_len)).decode(errors="replace")
        (length,) = bulk.LENGTH.unpack(await conn.recv_exact(bulk.LENGTH.size))
        if length > MAX_MESSAGE_BYTES:
            raise ValueError(f"a message of {length} bytes (at most {MAX_MESSAGE_BYTES})")
        context = Context(auth)
        if self.tokens is not None and self.tokens.island_for(context.invocation_metadata()) is None:
            self.servicer.counters.bulk_calls += method != bulk.SIDE
            raise Aborted(UNAUTHENTICATED)
        message = await conn.recv_exact(length)
        conn.expect(False)
        if method == bulk.SIDE:
            return await self._side(conn, auth, message) and self._keeps(keep)
        self.servicer.counters.bulk_calls += 1
        self.servicer.counters.bulk_kept_calls += not first
        if method not in bulk.STRIPED:
            if not await self._serve_call(conn, method, message, context, conn, eager):
                await self._drain(conn)
                return False
            return self._keeps(keep)
        call_id, _, count = bulk.STRIPE.unpack_from(message)
        if not 2 <= count <= bulk.MAX_STREAMS:
            raise ValueError(f"a call striped over {count} connections (2 to {bulk.MAX_STREAMS})")
        stripes = self._stripes.setdefault(call_id, StripeSet(count, auth))
        clean = False
        try:
            stripes.attach(0, conn, count, auth)
            try:
                await asyncio.wait_for(stripes.attached.wait(), PREAMBLE_SECONDS)
            except TimeoutError:
                came = sum(c is not None for c in stripes.conns)
                raise ValueError(f"a striped call: {came} of its {count} connections came") from None
            data = Striped(stripes.conns)
            try:
                message = message[bulk.STRIPE.size :]
                clean = await self._serve_call(conn, bulk.STRIPED[method], message, context, data, eager)
                stripes.clean = clean and await data.settle(PREAMBLE_SECONDS)
            finally:
                await data.close()
        finally:
            stripes.finished.set()
            if self._stripes.get(call_id) is stripes:
                del self._stripes[call_id]
        if not clean:  # answered with data unread (its sides, let go, read theirs meanwhile)
            await self._drain(conn)
        return stripes.clean and self._keeps(keep)

    async def _side(self, conn: Connection, auth: str, message: bytes) -> bool:
        """One more connection of a striped call: it waits for its lead, which reads and writes it;
        whether the call ended cleanly."""
        call_id, index, count = bulk.STRIPE.unpack(message)
        stripes = self._stripes.setdefault(call_id, StripeSet(count, auth))
        try:
            stripes.attach(index, conn, count, auth)
            await asyncio.wait_for(stripes.led.wait(), PREAMBLE_SECONDS)
        except BaseException:
            if self._stripes.get(call_id) is stripes and not stripes.led.is_set():
                del self._stripes[call_id]
            raise
        await stripes.finished.wait()
        if not stripes.clean:  # (an eager push's data may be on its way: read it into nothing)
            with contextlib.suppress(OSError):
                await self._drain(conn)
        return stripes.clean

    async def _serve_call(self, conn: Connection, method: int, message: bytes, context, data, eager=False) -> bool:
        """One push or pull: its answers on ``conn``, its data on ``data`` (``conn``, or its stripes);
        whether nothing of it is left unread (False: an eager push answered at its header, whose data
        came anyway; the caller reads it into nothing)."""
        if method == bulk.PUSH:
            push = BulkPush(conn, tolerant(deserialize_push_chunk)(message), data, eager)
            response = await self.servicer.PushDelta(push, context)
            conn.expect(False)
            await conn.send(bulk.frame(bulk.OK, response.SerializeToString()))
            return not push.eager or push.read
        request = tolerant(pb.PullRequest.FromString)(message)
        skip = getattr(request, "resume_offset", 0)  # a pull that broke: the rest of the same answer
        chunks = self.servicer.pull_chunks(request, context)
        async with contextlib.aclosing(chunks):  # its memory goes back as soon as the call ends
            async for chunk in chunks:
                if isinstance(chunk, RawData):
                    for part in [chunk.view] if chunk.parts is None else chunk.parts:
                        view = memoryview(part).cast("B")
                        if skip >= view.nbytes:
                            skip -= view.nbytes
                            continue
                        view, skip = view[skip:], 0
                        conn.expect()
                        await data.send(view)
                        conn.expect(False)  # the next entry may take a while to serialise: not idleness
                elif chunk.WhichOneof("kind") == "header":
                    if skip:
                        self._resume_at(skip, chunk.header, data)
                    await conn.send(bulk.frame(bulk.OK, chunk.header.SerializeToString()))
                else:  # a tentative update's round is saved and published
                    await self._flush(conn, data)
                    await conn.send(bulk.frame(bulk.OK, chunk.durable.SerializeToString()))
            await self._flush(conn, data)
        return True

    def _resume_at(self, skip: int, header: pb.UpdateHeader, data) -> None:
        """A resumed pull's answer from byte ``skip`` of its data on: refused (one reason, before the
        header goes) when that is past the answer (a bogus offset drove bytes_out to -2.77e19)."""
        total = sum(e.num_bytes for e in header.entries)
        if skip > total:
            raise Aborted(
                error_status(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    Reason.BAD_REQUEST,
                    f"resume_offset {skip} is past the answer's {total} bytes of data",
                )
            )
        counters = self.servicer.counters
        counters.bulk_pull_resumes += 1
        counters.bulk_resumed_bytes += skip
        counters.bytes_out -= skip  # the answer counts what it makes: these are not sent
        counters.resent(Resent.PULL_AGAIN, -skip)  # (a resumed answer is the one sent before)
        if isinstance(data, Striped):
            data.begin(skip)

    @staticmethod
    async def _flush(conn: Connection, data) -> None:
        """A striped pull's units all written (before the lead's Durable frame, and before the call ends
        and its memory goes)."""
        if data is not conn:
            conn.expect()
            await data.flush()
            conn.expect(False)
