"""gRPC core's own log lines about failed TLS handshakes, in the coordinator's words.

gRPC core writes its log to the process's stderr itself, below Python: an island with no client
certificate against a mutual-TLS coordinator, or speaking plaintext to a TLS one, made it print
``I1204 22:55:55.763878 7225 ssl_transport_security.cc:2563] Handshake failed with error SSL_ERROR_SSL:
error:100000f7:SSL routines:OPENSSL_internal:WRONG_VERSION_NUMBER: ...`` at every attempt, every
1-2 s. :class:`CoreLog` puts a pipe in front of file descriptor 2 while the daemon serves: such a line
becomes one WARNING a minute per cause, saying what the peer got wrong (gRPC's line names no peer;
the island's own error says which one it was, :mod:`atoll.islands._transport.probe`); every other byte goes
through to the real stderr unchanged, and Python's own writes bypass the pipe altogether. The
OpenSSL reason a line carries is the one thing read from it: gRPC offers no other channel for it.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import re
import sys
import threading
import time

log = logging.getLogger("atoll.coordinator")

CORE_LINE = re.compile(rb"^[IWEF]\d{4} [\d:.]+\s+\d+ ssl_transport_security\.cc:\d+\] Handshake failed")
CAUSES = {
    b"WRONG_VERSION_NUMBER": "a peer spoke plaintext (an island without --tls-ca?)",
    b"PEER_DID_NOT_RETURN_A_CERTIFICATE": "a peer sent no client certificate (mutual TLS: an island without "
    "--tls-cert/--tls-key?)",
    b"CERTIFICATE_VERIFY_FAILED": "a peer's client certificate is not signed by --tls-client-ca",
    b"TLSV1_ALERT_UNKNOWN_CA": "a peer does not trust this coordinator's certificate (an island with another "
    "--tls-ca?)",
}
"""What a handshake that failed with each OpenSSL reason means, for an operator."""


class CoreLog:
    """While started, file descriptor 2 is a pipe read by a thread that rewrites gRPC core's handshake
    lines (see the module) and passes everything else on; :meth:`stop` puts the real stderr back."""

    def __init__(self, every: float = 60.0) -> None:
        self.every = every
        self._said: dict[str, tuple[float, int]] = {}
        self._real: int | None = None
        self._stderr = None
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        read, write = os.pipe()
        self._real = os.dup(2)
        sys.stderr.flush()
        os.dup2(write, 2)
        os.close(write)
        self._stderr = sys.stderr  # Python's own writes go straight to the real stderr
        sys.stderr = open(os.dup(self._real), "w", buffering=1, errors="backslashreplace", closefd=True)  # noqa: SIM115
        for handler in logging.getLogger().handlers:  # and so do the log handlers set up before
            if isinstance(handler, logging.StreamHandler) and handler.stream is self._stderr:
                handler.setStream(sys.stderr)
        self._thread = threading.Thread(target=self._relay, args=(read,), name="atoll-corelog", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        if self._real is None:
            return
        os.dup2(self._real, 2)  # the pipe's last write end closes: the relay reads to its end and stops
        for handler in logging.getLogger().handlers:
            if isinstance(handler, logging.StreamHandler) and handler.stream is sys.stderr:
                handler.setStream(self._stderr)
        sys.stderr.close()
        sys.stderr, self._stderr = self._stderr, None
        if self._thread is not None:
            self._thread.join(5)
        os.close(self._real)
        self._real, self._thread = None, None

    def _relay(self, read: int) -> None:
        with open(read, "rb", buffering=0) as pipe:
            for line in pipe:
                try:
                    if not self.said(line):
                        os.write(self._real, line)
                except Exception:  # never lose the stream over one line
                    with contextlib.suppress(OSError):
                        os.write(self._real, line)

    def said(self, line: bytes) -> bool:
        """Whether ``line`` is a handshake line of gRPC core's, said (or counted) in our words instead."""
        if not CORE_LINE.match(line):
            return False
        cause = next((words for key, words in CAUSES.items() if key in line), None)
        cause = (
            cause
            or "a peer's TLS handshake failed ("
            + line.split(b"Handshake failed", 1)[1].decode(errors="replace").strip(" :\n")
            + ")"
        )
        now = time.monotonic()
        at, since = self._said.get(cause, (-math.inf, 0))
        if now - at < self.every:
            self._said[cause] = (at, since + 1)
            return True
        more = f" (and {since} more like it in the last minute)" if since else ""
        log.warning("TLS handshake refused: %s%s", cause, more)
        self._said[cause] = (now, 0)
        return True
