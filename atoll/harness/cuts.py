"""Cutting a connection the way a network does, for tests and benchmarks of resumed transfers."""

from __future__ import annotations

import fcntl
import socket
import struct
import termios
import time


def unacked_bytes(sock: socket.socket) -> int:
    """What ``sock`` has in its send queue: not yet sent or not yet acknowledged (Linux ``SIOCOUTQ``)."""
    return struct.unpack("i", fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, b"\0" * 4))[0]


def reset(sock: socket.socket, *, drained_within: float = 10.0) -> None:
    """Once what ``sock`` sent is acknowledged (or after ``drained_within`` seconds), end it with a reset
    (RST), as a middlebox or a dead link does: no orderly end of the stream reaches the peer."""
    deadline = time.monotonic() + drained_within
    while unacked_bytes(sock) and time.monotonic() < deadline:
        time.sleep(0.005)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()
