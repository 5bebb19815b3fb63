"""One accepted connection of the bulk port, as the event loop reads and writes it: in the clear
(:class:`Connection`), or over TLS (:class:`TlsConnection`: OpenSSL through memory BIOs, so the same
non-blocking socket calls carry the records and no thread is held per connection).

Each keeps the progress clock the bulk port's watchdog reads: ``since`` is when the connection last
moved bytes while the server expects it to, so a silent or trickling peer is cut off while a slow
wide-area transfer that keeps moving is not (sends advance it a slice at a time).
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import ssl
import time

SEND_SLICE = 4 << 20
"""Bytes sent between two readings of the progress clock (a 150 MiB entry over 100 Mbit/s takes 12 s)."""
TLS_SLICE = 1 << 20
"""Bytes encrypted at a time: the event loop is held for one slice's encryption (well under a ms)."""
RAW_BYTES = 256 << 10
"""The ciphertext read from the socket at a time."""


class Connection:
    """One accepted socket: exact reads and whole sends on the event loop, with its progress clock."""

    delimited = False
    """Whether a push's data ends at its declared length (True) or at the client's half-close (False,
    which also shows a stream that carries more than it declared)."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.loop = asyncio.get_running_loop()
        self.since: float | None = None
        """When this connection last made progress while expected to (None: not expected to now)."""
        self.limit: float | None = None
        """A deadline in seconds from :meth:`expect`, progress or not (None: the server's idle limit,
        counted from the last progress)."""
        self.timed_out = False
        self.received = 0
        """Bytes that came on the connection (TLS records included)."""
        self.clock: Connection = self
        """Whose progress clock this connection's bytes advance (a striped call's: its lead's)."""
        self.between_calls = False
        """A kept connection waiting for its next call (ending now is no failure)."""

    def expect(self, expecting: bool = True, limit: float | None = None) -> None:
        self.since, self.limit = (time.monotonic() if expecting else None), limit

    def _progress(self) -> None:
        if self.clock.limit is None:
            self.clock.since = time.monotonic()

    async def start(self) -> None:
        """Anything before the call's first byte (the TLS handshake)."""

    async def recv_into(self, view: memoryview) -> int:
        """Some bytes into ``view`` (at least one); EOFError at the end of the stream."""
        n = await self.loop.sock_recv_into(self.sock, view)
        if n == 0:
            raise EOFError("the peer ended the connection")
        self.received += n
        self._progress()
        return n

    async def recv_exact(self, n: int) -> bytes:
        """``n`` bytes, held as they arrive (a preamble that declares 16 MiB and sends 10 bytes costs
        its 10 bytes, not 16 MiB)."""
        out, piece = bytearray(), memoryview(bytearray(min(n, 1 << 16)))
        while len(out) < n:
            got = await self.recv_into(piece[: n - len(out)])
            out += piece[:got]
        return bytes(out)

    async def send(self, data) -> None:
        view = memoryview(data).cast("B")
        for start in range(0, max(view.nbytes, 1), SEND_SLICE):
            await self.loop.sock_sendall(self.sock, view[start : start + SEND_SLICE])
            self._progress()


class TlsConnection(Connection):
    """A connection whose bytes are TLS records: the handshake (and, with a client CA, the island's
    certificate) first; then reads decrypt straight into the caller's buffer (``SSLObject.read`` into
    it) and sends encrypt a slice at a time. A push's data ends at its declared length: ending it with
    a half-close would end TLS with it."""

    delimited = True

    def __init__(self, sock: socket.socket, context: ssl.SSLContext) -> None:
        super().__init__(sock)
        self._incoming, self._outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
        self._tls = context.wrap_bio(self._incoming, self._outgoing, server_side=True)
        self._raw = memoryview(bytearray(RAW_BYTES))

    async def start(self) -> None:
        try:
            while True:
                try:
                    self._tls.do_handshake()
                    break
                except ssl.SSLWantReadError:
                    await self._flush()
                    await self._more()
        except ssl.SSLError:
            with contextlib.suppress(OSError):
                await self._flush()  # the alert that tells the client why
            raise
        await self._flush()

    async def _more(self) -> None:
        n = await self.loop.sock_recv_into(self.sock, self._raw)
        if n == 0:
            raise EOFError("the peer ended the connection")
        self.received += n
        self._incoming.write(self._raw[:n])

    async def _flush(self) -> None:
        if self._outgoing.pending:
            await self.loop.sock_sendall(self.sock, self._outgoing.read())

    async def recv_into(self, view: memoryview) -> int:
        while True:
            try:
                n = self._tls.read(view.nbytes, view)
            except ssl.SSLWantReadError:
                await self._more()
                continue
            except ssl.SSLZeroReturnError:  # the peer's close_notify
                raise EOFError("the peer ended the connection") from None
            if n == 0:
                raise EOFError("the peer ended the connection")
            self._progress()
            return n

    async def send(self, data) -> None:
        view = memoryview(data).cast("B")
        for start in range(0, view.nbytes, TLS_SLICE):
            self._tls.write(view[start : start + TLS_SLICE])
            await self._flush()
            self._progress()
