"""Why a coordinator address that takes connections answers no gRPC call, when the cause is the island's
setup and not an outage: TLS against a plaintext coordinator or the reverse, a missing or untrusted
client certificate (mutual TLS), a server certificate that does not verify, or an HTTP/1.1 server
(the coordinator's admin port) where its gRPC port was meant.

gRPC reports all of these as UNAVAILABLE ("Socket closed"), the way it reports a coordinator that is
down, so an island retried them for its whole connect timeout. When the first Join cannot connect,
:func:`diagnose` opens one connection of its own: the HTTP/2 preface in the clear, or a TLS handshake
with the island's own certificates (ALPN h2, as gRPC does), and reads what comes back. The kind of
answer (a TLS alert's ``ssl`` reason, an HTTP/2 SETTINGS frame, an HTTP/1.x status line, or the
connection closed right after the handshake) says which it is. Nothing listening, or an address that
answers as a gRPC server should, is not the setup's fault: None, and the island keeps retrying.
"""

from __future__ import annotations

import socket
import ssl

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\x00\x00\x00\x04\x00\x00\x00\x00\x00"
"""The HTTP/2 client preface and an empty SETTINGS frame: a gRPC server answers with its SETTINGS."""
SETTINGS = 4
PROBE_SECONDS = 5.0


def diagnose(host: str, port: int, tls, timeout: float = PROBE_SECONDS) -> str | None:
    """What is wrong with reaching a gRPC server at ``host:port`` the way the island does (``tls``: its
    :class:`~atoll.islands._transport.client.ClientTls`, or None for plaintext), in words the user can act on;
    None when the cause is not the island's setup (nothing listens there, or it answers as it should)."""
    address = f"{host}:{port}"
    try:
        answer = _exchange(host, port, tls, timeout)
    except ssl.SSLCertVerificationError as err:
        return (
            f"the coordinator's TLS certificate at {address} does not verify with the island's CA {tls.ca} "
            f"({err.verify_message}): give it the CA that signed the coordinator's certificate (--tls-ca), "
            "and an address or --tls-server-name that the certificate names"
        )
    except ssl.SSLError as err:
        if err.reason == "WRONG_VERSION_NUMBER":  # the answer to its ClientHello was not TLS
            return (
                f"{address} does not speak TLS (the coordinator runs without --tls-cert, or this is not its "
                "gRPC port): drop the island's --tls-ca, or serve TLS"
            )
        return None
    except OSError:
        return None  # nothing listens, or the network: an outage, retried
    if answer.startswith(b"HTTP/"):
        return (
            f"{address} is an HTTP/1.x server, not the coordinator's gRPC port (the coordinator's admin port "
            "answers /healthz and /api/status there; islands take its --port)"
        )
    if len(answer) >= 9 and answer[3] == SETTINGS:
        return None  # a gRPC server that took the connection: the failure was something else
    if answer:
        return None
    # Closed without a word.
    if tls is None:
        if _speaks_tls(host, port, timeout):
            return (
                f"the coordinator at {address} serves TLS: give the island its CA (--tls-ca; ClientTls(ca=...)), "
                "and its own certificate and key if the coordinator asks for one (--tls-cert, --tls-key)"
            )
        return None
    if tls.cert is None:
        return (
            f"the coordinator at {address} requires a client certificate (mutual TLS: its --tls-client-ca): "
            "give the island one it trusts (--tls-cert, --tls-key)"
        )
    return (
        f"the coordinator at {address} does not accept the island's certificate {tls.cert}: it must be signed "
        "by the CA the coordinator's --tls-client-ca names"
    )


def _exchange(host: str, port: int, tls, timeout: float) -> bytes:
    """Open a connection as the island would, send the HTTP/2 preface, and read the first answer (b"": the
    server closed the connection)."""
    with socket.create_connection((host, port), timeout) as sock:
        sock.settimeout(timeout)
        if tls is None:
            sock.sendall(PREFACE)
            return _read(sock)
        ctx = ssl.create_default_context(cafile=tls.ca)
        if tls.cert:
            ctx.load_cert_chain(tls.cert, tls.key)
        ctx.set_alpn_protocols(["h2"])
        with ctx.wrap_socket(sock, server_hostname=tls.server_name or host) as wrapped:
            wrapped.sendall(PREFACE)
            return _read(wrapped)


def _read(sock) -> bytes:
    try:
        return sock.recv(64)
    except (ConnectionResetError, ssl.SSLEOFError):
        return b""


def _speaks_tls(host: str, port: int, timeout: float) -> bool:
    """Whether a TLS handshake (no verification: only the protocol matters) completes at ``host:port``."""
    ctx = ssl.create_default_context()
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    ctx.set_alpn_protocols(["h2"])
    try:
        with (
            socket.create_connection((host, port), timeout) as sock,
            ctx.wrap_socket(sock, server_hostname=host),
        ):
            return True
    except (OSError, ssl.SSLError):
        return False
