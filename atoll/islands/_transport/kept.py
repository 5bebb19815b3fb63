"""The bulk-port connections an island keeps open between its calls (:mod:`atoll.protos.bulk`, ``KEEP``).

Over a long link every new connection costs a round trip for TCP's handshake (two more for TLS's)
and starts in slow start, ~5 round trips to fill 1 Gbit/s at 80 ms: half a second that a 1 s
transfer pays again every call. A call that ended cleanly gives its connections back here and the
next call takes them. One the coordinator closed meanwhile (it keeps an idle one
``bulk_keep_seconds``; this side gives it up at 0.8 of that) shows as readable, since a coordinator
never sends on a connection unasked, and is closed here instead of being used.
"""

from __future__ import annotations

import select
import socket
import ssl
import threading
import time

MARGIN = 0.8
"""The share of the coordinator's keep time an idle connection is used within."""


def peer_spoke(sock: socket.socket, wait: float = 0.0) -> bool:
    """Bytes or an end wait on ``sock`` (or come within ``wait`` seconds): the coordinator, which sends
    nothing unasked (no TLS session tickets, no renegotiation), has answered (a push refused part way)
    or closed it (a kept one)."""
    if isinstance(sock, ssl.SSLSocket) and sock.pending():
        return True
    try:
        poller = select.poll()  # not select(): descriptors past 1024
        poller.register(sock, select.POLLIN)
        return bool(poller.poll(int(wait * 1000)))
    except (OSError, ValueError):  # closed already
        return True


class KeptConnections:
    """Idle connections by bulk port (thread-safe: a push and a pull may take and give at once)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._idle: dict[object, list[tuple[socket.socket, float]]] = {}
        self._closed = False

    def take(self, port, n: int, keep_seconds: float) -> list[socket.socket]:
        """Up to ``n`` idle connections to ``port`` still open, the most recently used first (their
        congestion windows are the warmest)."""
        taken, stale = [], []
        now = time.monotonic()
        with self._lock:
            idle = self._idle.get(port, [])
            while idle and len(taken) < n:
                sock, since = idle.pop()
                (taken if now - since < keep_seconds * MARGIN and not peer_spoke(sock) else stale).append(sock)
        for sock in stale:
            sock.close()
        return taken

    def give(self, port, socks: list[socket.socket]) -> None:
        """Keep ``socks`` for the next call; closed at once after :meth:`close` (a call that was still
        running when the island closed ends after it)."""
        now = time.monotonic()
        with self._lock:
            if not self._closed:
                self._idle.setdefault(port, []).extend((sock, now) for sock in socks)
                return
        for sock in socks:
            sock.close()

    def idle(self, port) -> int:
        """Connections to ``port`` waiting for a call (tests and benchmarks read it)."""
        with self._lock:
            return len(self._idle.get(port, []))

    def close(self) -> None:
        with self._lock:
            self._closed = True
            socks = [sock for idle in self._idle.values() for sock, _ in idle]
            self._idle.clear()
        for sock in socks:
            sock.close()
