"""The admin HTTP server's limits on its connections (hardening round 5, item 9): a cap on connections
held, a deadline for a request's headers and one for its body. 1,200 connections that each sent part of
a header were all still held 20 s later (before authentication, with --admin-host public)."""

from __future__ import annotations

import select
import socket
import time

from support import http, wait_for

from atoll.coordinator.transport.admin import AdminServer
from atoll.coordinator.transport.guard import ConnectionGuard


def closed_by_peer(sock: socket.socket) -> bool:
    if not select.select([sock], [], [], 0)[0]:
        return False
    try:
        return sock.recv(4096) == b""
    except (ConnectionResetError, BrokenPipeError):
        return True


def started(srv, guard: ConnectionGuard, token: str | None = None) -> AdminServer:
    admin = AdminServer(srv.server, port=0, token=token, guard=guard)
    srv.call(admin.start())
    return admin


def test_partial_headers_are_closed_and_connections_past_the_cap_refused(start_server):
    srv = start_server()
    guard = ConnectionGuard(max_connections=16, header_seconds=0.5)
    admin = started(srv, guard)
    socks = []
    try:
        for _ in range(60):
            s = socket.create_connection(("127.0.0.1", admin.port))
            s.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Slow: ")  # and never the rest
            socks.append(s)
        opened = time.monotonic()
        wait_for(lambda: all(closed_by_peer(s) for s in socks), timeout=10, what="every slow connection closed")
        assert time.monotonic() - opened < 3.0
        assert guard.refused >= 60 - 16 and guard.timed_out >= 1 and not guard.open
        assert http(admin.address + "/healthz")[0] == 200  # and it serves on
    finally:
        for s in socks:
            s.close()
        srv.call(admin.stop())


def test_a_body_that_does_not_come_is_answered_408(start_server):
    srv = start_server()
    guard = ConnectionGuard(header_seconds=5, body_seconds=0.5)
    admin = started(srv, guard, token="tok")
    try:
        with socket.create_connection(("127.0.0.1", admin.port), timeout=10) as s:
            s.sendall(
                b"POST /api/config HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer tok\r\n"
                b'Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{"quorum"'
            )
            answer = s.recv(4096)
        assert answer.startswith(b"HTTP/1.1 408"), answer[:80]
        assert srv.inspect(lambda st: st.config.quorum) == 1  # nothing changed
    finally:
        srv.call(admin.stop())
