"""The island's TLS settings: the trust and identity of its gRPC channel and of its bulk-port connections."""

from __future__ import annotations

import ssl
from dataclasses import dataclass

import grpc


@dataclass(frozen=True, kw_only=True)
class ClientTls:
    ca: str
    """PEM file of the CA that signed the coordinator's certificate."""
    cert: str | None = None
    """PEM certificate of this island (mutual TLS)."""
    key: str | None = None
    """PEM private key of this island (mutual TLS)."""
    server_name: str | None = None
    """Expected name in the coordinator's certificate, if not the address's host."""

    def credentials(self) -> grpc.ChannelCredentials:
        def read(path):
            with open(path, "rb") as f:
                return f.read()

        return grpc.ssl_channel_credentials(
            root_certificates=read(self.ca),
            private_key=read(self.key) if self.key else None,
            certificate_chain=read(self.cert) if self.cert else None,
        )

    def ssl_context(self) -> ssl.SSLContext:
        """The same trust and identity for the bulk port's TLS connections (Python's ``ssl``, OpenSSL):
        the coordinator's certificate must verify with ``ca`` and name the host (or ``server_name``)."""
        ctx = ssl.create_default_context(cafile=self.ca)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        if self.cert:
            ctx.load_cert_chain(self.cert, self.key)
        return ctx
