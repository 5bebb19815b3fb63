"""The admin HTTP server's limits on its connections, which aiohttp does not set: a cap on connections
held at once, a deadline for a request's headers, and one for the rest of a request (its body).

With ``--admin-host`` public, every connection is an unauthenticated peer until its headers are read:
1,200 connections that each sent part of a header were all still held 20 s later. Here a connection
past the cap is closed as it comes; one whose request headers are not complete ``header_seconds`` after
it opened, or after the first byte of its next request, is closed; a request whose handler (reading
its body included) takes longer than ``body_seconds`` is answered 408. aiohttp closes a connection
idle between requests after its ``keepalive_timeout``.
"""

from __future__ import annotations

import asyncio
import logging
import time

from aiohttp import web

log = logging.getLogger("atoll.coordinator")

MAX_CONNECTIONS = 256
HEADER_SECONDS = 10.0
BODY_SECONDS = 10.0
KEEPALIVE_SECONDS = 15.0
"""An idle kept connection is closed after this (aiohttp's default: an hour)."""
END_OF_HEADERS = b"\r\n\r\n"


class ConnectionGuard:
    """The connections held and the limits on them (one per admin server)."""

    def __init__(
        self,
        max_connections: int = MAX_CONNECTIONS,
        header_seconds: float = HEADER_SECONDS,
        body_seconds: float = BODY_SECONDS,
    ) -> None:
        self.max_connections, self.header_seconds, self.body_seconds = max_connections, header_seconds, body_seconds
        self.open: dict[object, GuardedProtocol] = {}
        """The admitted connections, by transport."""
        self.refused = 0
        """Connections closed as they came (past the cap)."""
        self.timed_out = 0
        """Connections closed for headers that did not come in time."""
        self._said = 0.0

    def protocol_factory(self, factory):
        return lambda: GuardedProtocol(factory(), self)

    def _note(self, what: str) -> None:
        now = time.monotonic()
        if now - self._said > 60:  # at most one line a minute, however many there are
            self._said = now
            log.warning("admin HTTP: %s (refused past the cap so far: %d, headers too slow: %d)", what,
                        self.refused, self.timed_out)  # fmt: skip

    @web.middleware
    async def middleware(self, request: web.Request, handler):
        """The request's body deadline; afterwards the connection waits for its next request's headers."""
        try:
            return await asyncio.wait_for(handler(request), self.body_seconds)
        except asyncio.TimeoutError:
            raise web.HTTPRequestTimeout(text=f"the request took longer than {self.body_seconds:g} s\n") from None
        finally:
            conn = self.open.get(request.transport)
            if conn is not None:
                conn.between_requests()


class GuardedProtocol(asyncio.Protocol):
    """aiohttp's protocol for one connection, behind the guard's cap and header deadline."""

    def __init__(self, inner: asyncio.Protocol, guard: ConnectionGuard) -> None:
        self.inner, self.guard = inner, guard
        self.transport: asyncio.Transport | None = None
        self._admitted = False
        self._timer: asyncio.TimerHandle | None = None
        self._tail = b""
        self._idle = False
        """Between two requests: the next byte starts a request whose headers have a deadline."""

    def connection_made(self, transport) -> None:
        self.transport = transport
        if len(self.guard.open) >= self.guard.max_connections:
            self.guard.refused += 1
            self.guard._note(f"{len(self.guard.open)} connections held, the most it holds; closing new ones")
            transport.abort()
            return
        self._admitted = True
        self.guard.open[transport] = self
        self._arm()
        self.inner.connection_made(transport)

    def _arm(self) -> None:
        self._timer = asyncio.get_running_loop().call_later(self.guard.header_seconds, self._too_slow)
        self._tail = b""

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _too_slow(self) -> None:
        self._timer = None
        self.guard.timed_out += 1
        self.guard._note(f"a request's headers did not come within {self.guard.header_seconds:g} s; closing it")
        if self.transport is not None:
            self.transport.abort()

    def between_requests(self) -> None:
        self._idle = True

    def data_received(self, data: bytes) -> None:
        if self._idle:
            self._idle = False
            self._arm()
        if self._timer is not None:
            seen = self._tail + data
            if END_OF_HEADERS in seen:
                self._disarm()
            else:
                self._tail = seen[-(len(END_OF_HEADERS) - 1) :]
        self.inner.data_received(data)

    def eof_received(self):
        return self.inner.eof_received() if self._admitted else None

    def connection_lost(self, exc) -> None:
        self._disarm()
        if self._admitted:
            self.guard.open.pop(self.transport, None)
            self.inner.connection_lost(exc)

    def pause_writing(self) -> None:
        self.inner.pause_writing()

    def resume_writing(self) -> None:
        self.inner.resume_writing()


class GuardedSite(web.TCPSite):
    """``web.TCPSite`` whose connections go through ``guard``."""

    def __init__(self, runner: web.BaseRunner, host: str, port: int, guard: ConnectionGuard) -> None:
        super().__init__(runner, host, port)
        self.guard = guard

    async def start(self) -> None:
        await web.BaseSite.start(self)
        server = self._runner.server
        assert server is not None
        self._server = await asyncio.get_running_loop().create_server(
            self.guard.protocol_factory(server), self._host, self._port, backlog=self._backlog
        )
        self._bound_port = self._server.sockets[0].getsockname()[1] if self._server.sockets else self._port
