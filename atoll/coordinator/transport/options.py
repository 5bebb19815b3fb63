"""How the coordinator meets islands and operators: where it listens, its admin server, its security.
Typed options, checked where they are made (:mod:`atoll.coordinator.options` builds them from the
command line)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from atoll.coordinator.transport.security import IslandTokens, TlsConfig
from atoll.coordinator.transport.service import STREAM_IDLE_SECONDS


def check_port(flag: str, port: int | None, low: int = 0) -> None:
    if port is not None and not low <= port <= 65535:
        raise ValueError(f"{flag} must be in {low}..65535, got {port}")


@dataclass(frozen=True, kw_only=True)
class NetworkOptions:
    """Where the coordinator listens for islands."""

    host: str = "127.0.0.1"
    port: int = 0
    """gRPC (control calls); 0 picks a free port."""
    port_file: Path | None = None
    bulk_port: int | None = 0
    """The TCP port for pushes and pulls beside gRPC; 0 picks a free one, None: none."""
    stream_idle_seconds: float = STREAM_IDLE_SECONDS

    def __post_init__(self) -> None:
        check_port("--port", self.port)
        check_port("--bulk-port", self.bulk_port)
        if not self.stream_idle_seconds > 0:
            raise ValueError(f"--stream-idle-seconds must be > 0, got {self.stream_idle_seconds}")


@dataclass(frozen=True, kw_only=True)
class AdminOptions:
    """The admin HTTP server: /healthz, /metrics, /api/status, the dashboard, control."""

    host: str = "127.0.0.1"
    port: int | None = None
    """None: no admin server; 0 picks a port."""
    token: str | None = None
    port_file: Path | None = None

    def __post_init__(self) -> None:
        check_port("--admin-port", self.port)


@dataclass(frozen=True, kw_only=True)
class SecurityOptions:
    tls: TlsConfig | None = None
    tokens: IslandTokens | None = None
    """Each island's bearer token; None: islands are not authenticated."""
