"""How a coordinator holds its run: which tensors it owns, how its state is kept, what it holds at
once. Typed options, checked where they are made (:mod:`atoll.coordinator.options` builds them from
the command line)."""

from __future__ import annotations

from dataclasses import dataclass

from atoll.coordinator.state.workers import auto_count
from atoll.sharding import PARTITIONS

MIN_LEASE_SECONDS, MAX_LEASE_SECONDS = 1.0, 86400.0
"""The store's lease: renewed every third of it, so under a second leaves a store's round trip no
room; past a day a dead coordinator's run waits longer than any operator would."""


@dataclass(frozen=True, kw_only=True)
class StorageOptions:
    """How the state is kept (where it is kept: :attr:`CoordinatorOptions.state_dir`)."""

    keep_snapshots: int = 2
    snapshot_every: int = 8
    lease_seconds: float = 15.0
    """With an object store: the run's lease there, which a coordinator replacing a dead one waits out."""
    standby: bool = False
    """With an object store: follow the run another coordinator serves, and take it over the moment
    that one's lease lapses (:mod:`atoll.coordinator.standby`)."""
    exact_failover: bool = False
    """Each round's outer optimizer state goes to the store before the round is published (2|θ| more
    before each publish, with a downlink codec): a standby continues bitwise whenever it takes over."""

    def __post_init__(self) -> None:
        if self.keep_snapshots < 1:
            raise ValueError(f"keep_snapshots must be >= 1, got {self.keep_snapshots}")
        if self.snapshot_every < 1:
            raise ValueError(f"snapshot_every must be >= 1, got {self.snapshot_every}")
        if not MIN_LEASE_SECONDS <= self.lease_seconds <= MAX_LEASE_SECONDS:  # (False for nan)
            raise ValueError(
                f"--store-lease-seconds must be in {MIN_LEASE_SECONDS:g}..{MAX_LEASE_SECONDS:g}, "
                f"got {self.lease_seconds}"
            )


MAX_TENSOR_WORKERS = 64
"""More threads than this would not find the memory bandwidth to use."""


@dataclass(frozen=True, kw_only=True)
class LimitsOptions:
    """Memory and CPU: what the coordinator holds and uses at once."""

    max_inflight_bytes: int = 0
    """Push bytes admitted at once (0: two whole fp32 pushes of the model, at least 256 MiB)."""
    max_pull_bytes: int = 0
    """Memory the pulls being answered hold at once (0: two fp32 copies of the model, at least 256 MiB)."""
    threads: int = 0
    """torch intra-op threads (0: torch's default)."""
    tensor_workers: int = 0
    """Threads that step and decode θ's tensors several at once (0: one per core the intra-op threads
    leave idle, :func:`~atoll.coordinator.state.workers.auto_count`)."""

    def __post_init__(self) -> None:
        for name in ("max_inflight_bytes", "max_pull_bytes", "threads", "tensor_workers"):
            if getattr(self, name) < 0:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 0, got {getattr(self, name)}")
        if self.tensor_workers > MAX_TENSOR_WORKERS:
            raise ValueError(f"--tensor-workers must be <= {MAX_TENSOR_WORKERS}, got {self.tensor_workers}")

    def workers(self) -> int:
        """The tensor workers to start."""
        return self.tensor_workers or auto_count(self.threads)


@dataclass(frozen=True, kw_only=True)
class PlacementOptions:
    """Which tensors this coordinator owns."""

    shard: tuple[int, int] = (0, 1)
    partition: str = "hash"
    fragments: int = 0
    """Streaming DiLoCo: serve all P fragments from this process (0: off)."""

    def __post_init__(self) -> None:
        if self.partition not in PARTITIONS:
            raise ValueError(f"partition must be one of {PARTITIONS}, got {self.partition!r}")
        if self.fragments < 0:
            raise ValueError(f"--fragments must be >= 0, got {self.fragments}")
        if self.fragments and self.shard != (0, 1):
            raise ValueError("--fragments runs every shard of the run itself; drop --shard")
