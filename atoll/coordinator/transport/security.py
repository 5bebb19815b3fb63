"""Transport security and island identity for the coordinator.

- TLS (server certificate) or mutual TLS (clients must present a certificate signed by
  ``client_ca``), certificates by path.
- Per-island bearer tokens: a JSON file ``{"island-id": "token", ...}``. An interceptor refuses
  calls without a known token (UNAUTHENTICATED); the servicer then checks that the island a
  request speaks for is the token's island (PERMISSION_DENIED): an island may act only for itself.
"""

from __future__ import annotations

import hmac
import json
import ssl
from dataclasses import dataclass
from pathlib import Path

import grpc

from atoll.protos.reasons import Reason
from atoll.protos.status import error_status

HEALTH_PREFIX = "/grpc.health.v1.Health/"
UNAUTHENTICATED = error_status(
    grpc.StatusCode.UNAUTHENTICATED, Reason.UNAUTHENTICATED, "missing or unknown island token"
)


@dataclass(frozen=True, kw_only=True)
class TlsConfig:
    cert: Path
    """PEM certificate chain of this server."""
    key: Path
    """PEM private key of this server."""
    client_ca: Path | None = None
    """If set, require client certificates signed by this CA (mutual TLS)."""

    def server_credentials(self) -> grpc.ServerCredentials:
        ca = Path(self.client_ca).read_bytes() if self.client_ca else None
        pair = (Path(self.key).read_bytes(), Path(self.cert).read_bytes())
        return grpc.ssl_server_credentials([pair], root_certificates=ca, require_client_auth=ca is not None)

    def ssl_context(self) -> ssl.SSLContext:
        """The same certificate, key and client CA for the bulk port (Python's ``ssl``: OpenSSL)."""
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        ctx.load_cert_chain(self.cert, self.key)
        if self.client_ca:
            ctx.verify_mode = ssl.CERT_REQUIRED
            ctx.load_verify_locations(cafile=self.client_ca)
        ctx.num_tickets = 0  # nothing unasked after the handshake: a pushing island reads only answers
        return ctx


class IslandTokens:
    """token -> island id, loaded from ``{"island": "token"}``."""

    def __init__(self, by_island: dict[str, str]) -> None:
        if (
            not isinstance(by_island, dict)
            or not by_island
            or not all(isinstance(k, str) and isinstance(v, str) and v for k, v in by_island.items())
        ):
            raise ValueError("island tokens must be a non-empty JSON object of island id -> token string")
        if len(set(by_island.values())) != len(by_island):
            raise ValueError("each island needs its own token")
        self._by_island = dict(by_island)

    @classmethod
    def load(cls, path: Path) -> IslandTokens:
        return cls(json.loads(Path(path).read_text()))

    def island_for(self, metadata) -> str | None:
        """The island whose token the call carries (constant-time compare), or None."""
        given = dict(metadata or ()).get("authorization", "")
        if not given.startswith("Bearer "):
            return None
        token = given[len("Bearer ") :].encode()
        found = None
        for island, expected in self._by_island.items():
            if hmac.compare_digest(token, expected.encode()):
                found = island
        return found


class TokenInterceptor(grpc.aio.ServerInterceptor):
    """Refuses every atoll RPC that carries no known island token (health checks stay open)."""

    def __init__(self, tokens: IslandTokens) -> None:
        self.tokens = tokens

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or handler_call_details.method.startswith(HEALTH_PREFIX):
            return handler  # an unknown method: gRPC answers UNIMPLEMENTED
        if self.tokens.island_for(handler_call_details.invocation_metadata) is None:
            return _refusal(handler)
        return handler


def _refusal(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    async def deny(request, context):
        await context.abort_with_status(UNAUTHENTICATED)

    kwargs = {"request_deserializer": handler.request_deserializer, "response_serializer": handler.response_serializer}
    if handler.unary_unary:
        return grpc.unary_unary_rpc_method_handler(deny, **kwargs)
    if handler.stream_unary:
        return grpc.stream_unary_rpc_method_handler(deny, **kwargs)
    if handler.unary_stream:

        async def deny_stream(request, context):
            await context.abort_with_status(UNAUTHENTICATED)
            yield  # pragma: no cover - unreachable, makes this an async generator

        return grpc.unary_stream_rpc_method_handler(deny_stream, **kwargs)
    return grpc.stream_stream_rpc_method_handler(deny, **kwargs)
