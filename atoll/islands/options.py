"""What an island asks of the run and how it talks to the coordinator: one frozen config, checked once."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from atoll.compression import get_codec
from atoll.islands.client import ClientTls, RetryPolicy, parse_addresses
from atoll.islands.exchange import Placement


@dataclass(frozen=True, kw_only=True)
class IslandOptions:
    coordinator: str
    """``host:port`` of the coordinator, or its shards (fragments) comma-separated."""
    run_id: str = "atoll"
    sync_every: int | None = None
    """H for this island; None takes the run's (a different value is warned about)."""
    codec: str | None = None
    """A codec name insists on the run's codec being that one; a spec with parameters
    (``"int8:block=64"``) must match the run's exactly."""
    heartbeat_seconds: float = 5.0
    pull_wait_seconds: float = 10.0
    """How long one long-poll pull waits at the coordinator."""
    retry: RetryPolicy | None = None
    connect_timeout_seconds: float = 120.0
    """How long ``start()`` tries to reach the coordinator before it raises."""
    sync_every_seconds: float | None = None
    """Sync on this time budget instead of every H steps."""
    overlap_steps: int = 0
    """τ: apply the outer update τ inner steps after the push, training meanwhile (0: plain DiLoCo)."""
    streaming: bool = False
    """The coordinator's shards are Streaming DiLoCo fragments on staggered schedules."""
    outer_state: str = "host"
    """Where round-start θ, residuals and snapshots live: "host" or "device"."""
    sync_buffers: bool = True
    """Average floating-point buffers (BatchNorm statistics) over the islands too."""
    keep_last_delta: bool = False
    """Keep the last pseudo-gradient as tensors (``DiLoCo.last_delta``; for inspection)."""
    token: str | None = None
    tls: ClientTls | None = None
    client_factory: Callable | None = field(default=None, compare=False)
    before_push: Callable | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        parse_addresses(self.coordinator)
        if self.codec is not None:
            get_codec(self.codec)  # ValueError with the reason for a bad spec
        if self.sync_every is not None and self.sync_every < 1:
            raise ValueError(f"sync_every must be >= 1, got {self.sync_every}")
        if self.sync_every_seconds is not None and not self.sync_every_seconds > 0:
            raise ValueError(f"sync_every_seconds must be > 0, got {self.sync_every_seconds}")
        if self.overlap_steps < 0:
            raise ValueError(f"overlap_steps must be >= 0, got {self.overlap_steps}")
        if self.streaming and self.sync_every_seconds is not None:
            raise ValueError("streaming staggers fragments by inner steps; it cannot sync on a time budget")
        if not self.connect_timeout_seconds > 0:
            raise ValueError(f"connect_timeout_seconds must be > 0, got {self.connect_timeout_seconds}")
        if not (self.heartbeat_seconds > 0 and self.pull_wait_seconds >= 0):
            raise ValueError("heartbeat_seconds must be > 0 and pull_wait_seconds >= 0")
        Placement(self.outer_state, torch.device("cpu"))  # ValueError for an unknown placement

    @property
    def addresses(self) -> list[str]:
        return parse_addresses(self.coordinator)
