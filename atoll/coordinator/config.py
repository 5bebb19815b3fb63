"""Run configuration: what every island and the coordinator agree on for one run."""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass

from atoll.compression import get_codec
from atoll.protos import coordinator_pb2 as pb


@dataclass(frozen=True, kw_only=True)
class RunConfig:
    run_id: str = "atoll"
    """Name of the run; every request must carry it."""
    sync_every: int = 50
    """H: inner steps per round."""
    outer_lr: float = 0.7
    """Outer SGD learning rate (DiLoCo default 0.7)."""
    outer_momentum: float = 0.9
    """Outer momentum (DiLoCo default 0.9)."""
    nesterov: bool = True
    """Nesterov momentum (DiLoCo) rather than heavy-ball."""
    codec: str = "identity"
    """Codec islands use for their pseudo-gradients."""
    downlink_codec: str = "identity"
    """Codec of the outer update sent back to islands (with downlink error feedback)."""
    error_feedback: bool = False
    """Islands carry what the lossy uplink codec dropped into the next round (per-rank residual)."""
    error_feedback_decay: float = 1.0
    """Error feedback sends C(Δ + β·e): the residual decays by β each round (1: classic EF).

    An island restarts every round from the global θ and re-learns what it did not transmit, so
    with β = 1 a coordinate's residual grows by about one Δ per round until top-k picks it. The
    value then sent is many rounds' worth. In a 20-round top-k 1% demo that made the global θ
    diverge; β = 0.5 kept it converging (benchmarks/RESULTS.md)."""
    late_policy: str = "drop"
    """A push for a closed round: "drop" it, or "fold" it into the open round (down-weighted)."""
    staleness_weight: float = 0.5
    """fold: a delta k rounds late weighs staleness_weight**k times its tokens."""
    max_staleness: int = 1
    """fold: pushes more than this many rounds late are dropped."""
    aggregation: str = "mean"
    """How deltas are combined: "mean" (token-weighted), "clipped_mean" or "median" (robust)."""
    clip_norm: float = 0.0
    """clipped_mean: clip each island's delta to this L2 norm (0: the median of the islands' norms)."""
    max_delta_norm: float = 0.0
    """Refuse an island's delta whose L2 norm exceeds this (0: no bound)."""
    quorum: int = 1
    """Minimum committed islands for a round to close at its deadline."""
    round_deadline_seconds: float = 600.0
    """After this long since the round opened, a round with quorum closes without stragglers."""
    lease_seconds: float = 30.0
    """An island not heard from for this long stops counting as live."""

    def __post_init__(self) -> None:
        if not self.run_id or len(self.run_id) > 128:
            raise ValueError(f"run_id must be 1..128 characters, got {self.run_id!r}")
        if self.sync_every < 1:
            raise ValueError(f"sync_every must be >= 1, got {self.sync_every}")
        if not (math.isfinite(self.outer_lr) and self.outer_lr > 0):
            raise ValueError(f"outer_lr must be a positive number, got {self.outer_lr}")
        if not (0.0 <= self.outer_momentum < 1.0):
            raise ValueError(f"outer_momentum must be in [0, 1), got {self.outer_momentum}")
        for field in ("codec", "downlink_codec"):
            try:
                get_codec(getattr(self, field))
            except ValueError as err:
                raise ValueError(f"{field}: {err}") from None
        if not 0 < self.error_feedback_decay <= 1:
            raise ValueError(f"error_feedback_decay must be in (0, 1], got {self.error_feedback_decay}")
        if self.late_policy not in ("drop", "fold"):
            raise ValueError(f"late_policy must be 'drop' or 'fold', got {self.late_policy!r}")
        if not 0 < self.staleness_weight <= 1:
            raise ValueError(f"staleness_weight must be in (0, 1], got {self.staleness_weight}")
        if self.max_staleness < 1:
            raise ValueError(f"max_staleness must be >= 1, got {self.max_staleness}")
        if self.aggregation not in ("mean", "clipped_mean", "median"):
            raise ValueError(f"aggregation must be mean, clipped_mean or median, got {self.aggregation!r}")
        if self.clip_norm < 0 or self.max_delta_norm < 0:
            raise ValueError("clip_norm and max_delta_norm must be >= 0")
        if self.quorum < 1:
            raise ValueError(f"quorum must be >= 1, got {self.quorum}")
        if not self.round_deadline_seconds > 0:
            raise ValueError(f"round_deadline_seconds must be > 0, got {self.round_deadline_seconds}")
        if not self.lease_seconds > 0:
            raise ValueError(f"lease_seconds must be > 0, got {self.lease_seconds}")

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> RunConfig:
        return cls(**json.loads(text))

    def to_proto(self) -> pb.RunConfigProto:
        return pb.RunConfigProto(**dataclasses.asdict(self))
