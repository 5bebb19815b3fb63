"""Opening a call on the coordinator's bulk port (:mod:`atoll.protos.bulk`): where the port is, its
connections (kept ones first, new ones opened together, TLS when the coordinator speaks it), each
with its preamble sent, and how many a call is striped over for the link's round trip."""

from __future__ import annotations

import math
import os
import socket
import ssl
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from atoll.islands._transport.kept import KeptConnections
from atoll.protos import bulk

CONNECT_SECONDS = 10.0
AUTO_STRIPE_RTT = 0.005
"""Below this round trip a call uses one connection (loopback, a LAN: one stream fills the link)."""
AUTO_MAX_STREAMS = 8


class BulkUnreachable(ConnectionError):
    """The bulk port refused or did not answer the connection, or its TLS handshake failed."""


@dataclass(frozen=True)
class BulkPort:
    """Where the coordinator's bulk port is (its Join advertised it): pushes and pulls go there."""

    host: str
    port: int
    tls: ssl.SSLContext | None = None
    """The island's TLS context when the coordinator serves TLS (the bulk port then does too)."""
    server_name: str | None = None
    """The name the coordinator's certificate must carry, if not ``host``."""
    streams: int = 1
    """The most connections the coordinator takes for one call (its Join's ``bulk_streams``)."""
    keep_seconds: float = 0.0
    """How long the coordinator keeps a connection between calls (its Join's; 0: one call each)."""


def connect(port: BulkPort) -> tuple[socket.socket, float]:
    """A TCP connection to the bulk port, and the seconds its handshake took (one round trip)."""
    started = time.perf_counter()
    try:
        sock = socket.create_connection((port.host, port.port), timeout=CONNECT_SECONDS)
    except OSError as err:
        raise BulkUnreachable(f"bulk port {port.host}:{port.port}: {err}") from None
    return sock, time.perf_counter() - started


def _open(port: BulkPort, method: int, auth: str, message: bytes, timeout: float) -> tuple[socket.socket, float]:
    """A connection to the bulk port (TLS when ``port.tls``), its preamble sent; and its round trip."""
    sock, rtt = connect(port)
    if port.tls is not None:
        try:
            sock = port.tls.wrap_socket(sock, server_hostname=port.server_name or port.host)
        except OSError as err:  # ssl.SSLError is one: a handshake gRPC's would have failed too, or a reset
            sock.close()
            raise BulkUnreachable(f"bulk port {port.host}:{port.port}: TLS handshake: {err}") from None
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        _begin(sock, method, auth, message, timeout)
    except OSError as err:
        sock.close()
        raise bulk.broken(f"{type(err).__name__}: {err}") from None
    return sock, rtt


def _begin(sock: socket.socket, method: int, auth: str, message: bytes, timeout: float) -> None:
    sock.settimeout(timeout)
    sock.sendall(bulk.preamble(method, auth, message))


def _reuse(kept: list[socket.socket], method: int, auth: str, message: bytes, timeout: float):
    """The preamble sent on a kept connection (None: none left that takes it; a new one is opened)."""
    while kept:
        sock = kept.pop()
        try:
            _begin(sock, method, auth, message, timeout)
            return sock, None
        except OSError:  # closed meanwhile
            sock.close()
    return None


def open_call(
    port: BulkPort,
    method: int,
    auth: str,
    message: bytes,
    timeout: float,
    streams: int,
    kept: KeptConnections | None = None,
    eager: bool = False,
) -> tuple[list[socket.socket], float | None]:
    """The connections of one call, their preambles sent (one, or ``streams`` for a striped call: the
    lead carries the call, the others join it): kept ones first when the coordinator keeps them (the
    call then asks to be kept too), new ones opened together; and the shortest handshake seen (None
    when every connection was a kept one). ``eager``: a push whose data follows without CONTINUE."""
    keep = kept is not None and port.keep_seconds > 0
    flag = bulk.KEEP if keep else 0
    lead = flag | (bulk.EAGER if eager else 0)
    if streams <= 1:
        jobs = [(method | lead, message)]
    else:
        call_id = os.urandom(16)
        striped = {bulk.PUSH: bulk.PUSH_STRIPED, bulk.PULL: bulk.PULL_STRIPED}[method]
        jobs = [(striped | lead, bulk.STRIPE.pack(call_id, 0, streams) + message)]
        jobs += [(bulk.SIDE | flag, bulk.STRIPE.pack(call_id, i, streams)) for i in range(1, streams)]
    idle = kept.take(port, len(jobs), port.keep_seconds) if keep else []
    opened: list[tuple[socket.socket, float | None] | None] = [_reuse(idle, m, auth, msg, timeout) for m, msg in jobs]
    fresh = [i for i, got in enumerate(opened) if got is None]
    failed = []
    if len(fresh) == 1:  # (no thread for the one connection of a call that is not striped)
        (i,) = fresh
        try:
            opened[i] = _open(port, jobs[i][0], auth, jobs[i][1], timeout)
        except Exception as err:  # BulkUnreachable, or a broken preamble
            failed.append(err)
    elif fresh:
        with ThreadPoolExecutor(len(fresh), thread_name_prefix="atoll-bulk-open") as pool:
            opening = {i: pool.submit(_open, port, jobs[i][0], auth, jobs[i][1], timeout) for i in fresh}
        for i, future in opening.items():
            try:
                opened[i] = future.result()
            except Exception as err:
                failed.append(err)
    if failed:
        for got in opened:
            if got is not None:
                got[0].close()
        raise failed[0]
    rtts = [rtt for _, rtt in opened if rtt is not None]
    return [sock for sock, _ in opened], min(rtts, default=None)


def auto_streams(rtt: float | None, limit: int) -> int:
    """Connections for a call over a link of round trip ``rtt`` (None: not measured yet): one on a LAN;
    else enough to fill 1 Gbit/s when each carries what Linux's default 4 MiB send buffer keeps in
    flight (~2.6 MB: one stream measured 259 Mbit/s at 80 ms), one per 20 ms, at most ``limit``."""
    if rtt is None or rtt < AUTO_STRIPE_RTT or limit <= 1:
        return 1
    return max(2, min(limit, math.ceil(rtt / 0.020)))
