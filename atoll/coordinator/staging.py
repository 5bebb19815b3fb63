"""The open round's contributions, and the memory budget of pushes in flight.

A push is classified once (:func:`classify`) against the open round; its ranks are staged until the
island's last rank arrives, then the island's contribution commits whole. Staged bytes are held
against :class:`InflightBudget`: memory follows the bytes actually received, never the sizes a
header declares.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch

from atoll.compression.base import weighted
from atoll.coordinator.errors import Reason, refuse
from atoll.coordinator.regions import Region


class InflightBudget:
    """Bytes of push payloads held by the coordinator (streaming in, or staged for an island's other
    ranks). A reservation past ``limit`` is refused (INFLIGHT_BUDGET): the island retries later."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.used = 0
        self.peak = 0

    def reserve(self, num_bytes: int) -> None:
        if self.used + num_bytes > self.limit:
            raise refuse(
                Reason.INFLIGHT_BUDGET,
                f"in-flight push budget spent ({self.used + num_bytes} > {self.limit} bytes); retry shortly",
            )
        self.used += num_bytes
        self.peak = max(self.peak, self.used)

    def release(self, num_bytes: int) -> None:
        self.used -= num_bytes
        if self.used < 0:
            raise AssertionError("in-flight budget released more than it reserved")


class Reservation:
    """One push's share of the budget; grows as bytes arrive, released exactly once."""

    def __init__(self, budget: InflightBudget) -> None:
        self.budget = budget
        self.bytes = 0

    def add(self, num_bytes: int) -> None:
        self.budget.reserve(num_bytes)
        self.bytes += num_bytes

    def release(self) -> None:
        self.budget.release(self.bytes)
        self.bytes = 0


@dataclass(frozen=True)
class EntryPlan:
    name: str
    region: Region
    num_bytes: int


@dataclass(frozen=True)
class PushPlan:
    """A validated push header: what the data stream must contain."""

    island_id: str
    round: int
    init: bool
    rank: int
    num_ranks: int
    tokens: int
    loss: float | None
    codec: str
    entries: tuple[EntryPlan, ...]
    late: bool = False

    @property
    def num_bytes(self) -> int:
        return sum(e.num_bytes for e in self.entries)


@dataclass
class StagedRank:
    plan: PushPlan
    payloads: list
    """Validated, still-encoded payloads, one per entry."""
    reservation: Reservation | None = None


@dataclass
class Committed:
    tokens: int
    loss: float | None
    num_bytes: int
    weight: float
    """Weight of the delta in the round's average: tokens, times staleness_weight^k if k rounds late."""


class PushClass(enum.Enum):
    NEW = "new"
    LATE = "late"
    """For a closed round, folded into the open one (late policy "fold", not too stale)."""
    DUPLICATE = "duplicate"
    CLOSED = "closed"
    """For a closed round that is not folded: dropped."""
    FUTURE = "future"


def classify(push_round: int, open_round: int, *, sealed: bool, fold: bool, max_staleness: int) -> PushClass:
    """Where a push for ``push_round`` stands. ``sealed``: the open round's outer step is computed
    and waits to be saved (it takes nothing more; the next round is not open yet)."""
    if push_round > open_round:
        return PushClass.FUTURE
    if sealed:
        return PushClass.CLOSED
    if push_round == open_round:
        return PushClass.NEW
    if fold and open_round - push_round <= max_staleness:
        return PushClass.LATE
    return PushClass.CLOSED


@dataclass
class Staging:
    """The open round's contributions (and late ones folded into it)."""

    pending: dict[tuple[str, int], dict[int, StagedRank]] = field(default_factory=dict)
    """Ranks staged so far, by (island, round the push is for)."""
    committed: dict[str, Committed] = field(default_factory=dict)
    """Islands whose contribution to the open round is complete."""
    late: dict[tuple[str, int], Committed] = field(default_factory=dict)
    """Late contributions (island, their round) folded into the open round's accumulator."""
    folded: set[tuple[str, int]] = field(default_factory=set)
    """Every (island, round) folded in recent rounds: a late delta is applied once."""
    dense: dict[tuple[str, int], tuple[float, dict[str, torch.Tensor]]] = field(default_factory=dict)
    """Robust aggregation: each contribution's (weight, dense delta) for the open round."""

    def is_duplicate(self, island_id: str, round_: int, rank: int, cls: PushClass) -> bool:
        key = (island_id, round_)
        done = key in self.folded if cls is PushClass.LATE else island_id in self.committed
        return done or rank in self.pending.get(key, {})

    def is_done(self, island_id: str, round_: int, cls: PushClass) -> bool:
        return (island_id, round_) in self.folded if cls is PushClass.LATE else island_id in self.committed

    def stage(self, staged: StagedRank, num_ranks: int) -> list[StagedRank] | None:
        """Add one rank; returns the island's ranks in order once all are in (and unstages them)."""
        key = (staged.plan.island_id, staged.plan.round)
        ranks = self.pending.setdefault(key, {})
        ranks[staged.plan.rank] = staged
        if len(ranks) < num_ranks:
            return None
        del self.pending[key]
        return [ranks[r] for r in sorted(ranks)]

    def commit(self, island_id: str, round_: int, record: Committed, late: bool) -> None:
        if late:
            self.late[(island_id, round_)] = record
            self.folded.add((island_id, round_))
        else:
            self.committed[island_id] = record

    def committed_islands(self) -> list[str]:
        return sorted(self.committed)

    def weight_total(self) -> float:
        return sum(c.weight for c in self.committed.values()) + sum(c.weight for c in self.late.values())

    def drop_island(self, island_id: str) -> None:
        """Forget an island's staged (incomplete) pushes."""
        for key in [k for k in self.pending if k[0] == island_id]:
            release(self.pending.pop(key).values())

    def advance(self, keep_from: int) -> None:
        """The round closed: clear its contributions; keep staged pushes for rounds >= ``keep_from``."""
        self.committed, self.late, self.dense = {}, {}, {}
        for key in [k for k in self.pending if k[1] < keep_from]:
            release(self.pending.pop(key).values())
        self.folded = {k for k in self.folded if k[1] >= keep_from - 1}

    def staged_bytes(self) -> int:
        return sum(r.plan.num_bytes for ranks in self.pending.values() for r in ranks.values())


def release(ranks) -> None:
    for staged in ranks:
        if staged.reservation is not None:
            staged.reservation.release()


def assemble(ranks: list[StagedRank], specs: dict[str, tuple[int, ...]], codec) -> dict[str, torch.Tensor]:
    """An island's whole delta, decoded densely (for the norm bound and robust aggregation)."""
    out = {k: torch.zeros(s, dtype=torch.float32) for k, s in specs.items()}
    for staged in ranks:
        for entry, payload in zip(staged.plan.entries, staged.payloads, strict=True):
            out[entry.name][entry.region.slices()] = codec.decode(payload, entry.region.sizes)
    return out


def accumulate(ranks: list[StagedRank], accum: dict[str, torch.Tensor], codec, weight: float) -> None:
    """``accum += weight * Δ`` for an island's ranks, decoding straight into the accumulator. ``weight * Δ``
    is rounded before the add, so two islands sum to the same bits in either arrival order."""
    for staged in ranks:
        for entry, payload in zip(staged.plan.entries, staged.payloads, strict=True):
            target = accum[entry.name][entry.region.slices()]
            if target.is_contiguous():
                codec.decode_add_(payload, target, alpha=weight)
            else:
                target.add_(weighted(codec.decode(payload, entry.region.sizes), weight))  # no fused w·Δ + acc
