"""What a push is while the coordinator holds it: its plan, its staged ranks, its share of the in-flight
budget, its class against the open round, and the decoding of an island's ranks (dense, or added
into a sum).

A push is classified once (:func:`classify`) against the open round; the accumulator
(:mod:`atoll.coordinator.accumulator`) stages its ranks. Staged bytes are held against
:class:`InflightBudget`: memory follows the bytes actually received, never the sizes a header declares.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch

from atoll.compression.base import weighted
from atoll.coordinator.errors import Reason, refuse
from atoll.coordinator.regions import Region


class InflightBudget:
    """Bytes of memory the coordinator holds room for. The pushes': payloads declared by admitted streams
    (reserved at their header), or staged for an island's other ranks; the pulls': what their answers
    hold while they stream. A reservation past ``limit`` is refused (``reason``: INFLIGHT_BUDGET, or
    PULL_BUDGET) before the transfer's data flows: the island retries later."""

    def __init__(self, limit: int, reason: Reason = Reason.INFLIGHT_BUDGET, what: str = "in-flight push") -> None:
        self.limit = limit
        self.used = 0
        self.peak = 0
        self.reason, self.what = reason, what

    def reserve(self, num_bytes: int) -> None:
        if self.used + num_bytes > self.limit:
            raise refuse(
                self.reason,
                f"{self.what} budget spent ({self.used + num_bytes} > {self.limit} bytes); retry shortly",
            )
        self.used += num_bytes
        self.peak = max(self.peak, self.used)

    def release(self, num_bytes: int) -> None:
        self.used -= num_bytes
        if self.used < 0:
            raise AssertionError("in-flight budget released more than it reserved")


class Reservation:
    """One push's share of the budget (its declared bytes, held from its header on); released exactly once."""

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
    inner_steps: int = 0
    compute_seconds: float = 0.0
    blocked_seconds: float = 0.0

    @property
    def num_bytes(self) -> int:
        return sum(e.num_bytes for e in self.entries)


@dataclass
class Received:
    """One rank's push as its entries arrive, each validated: the payloads, and the most any of their
    values decodes to in magnitude (the largest of the entries' norm bounds)."""

    payloads: list = field(default_factory=list)
    magnitude: float = 0.0

    def add(self, payloads: list, bounds: list[float]) -> None:
        self.payloads += payloads
        self.magnitude = max([self.magnitude, *bounds])


@dataclass
class StagedRank:
    plan: PushPlan
    payloads: list
    """Validated, still-encoded payloads, one per entry."""
    reservation: Reservation | None = None
    magnitude: float = 0.0
    """The most any value of its payloads decodes to in magnitude (the largest entry's norm bound)."""


@dataclass
class Committed:
    tokens: int
    loss: float | None
    num_bytes: int
    weight: float
    """Weight of the delta in the round's average: tokens, times staleness_weight^k if k rounds late."""
    inner_steps: int = 0
    compute_seconds: float = 0.0
    at: float | None = None
    """Clock time it committed (the grace window counts from the quorum's)."""


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


def accumulate(
    ranks: list[StagedRank], accum: dict[str, torch.Tensor], codec, weight: float, stale: set[str] | None = None
) -> None:
    """``accum += weight * Δ`` for an island's ranks, decoding straight into the accumulator. ``weight * Δ``
    is rounded before the add, so two islands sum to the same bits in either arrival order. A tensor
    named in ``stale`` holds old values that count as zero: an entry covering all of it is written
    (``weight * Δ``, the bits ``0 + weight * Δ`` gives), else the tensor is zeroed first; its name
    leaves ``stale`` either way."""
    for staged in ranks:
        for entry, payload in zip(staged.plan.entries, staged.payloads, strict=True):
            whole = accum[entry.name]
            target = whole[entry.region.slices()]
            if stale is not None and entry.name in stale:
                stale.discard(entry.name)
                if target.numel() == whole.numel() and target.is_contiguous():
                    codec.write_weighted_(payload, target, alpha=weight, verified=True)
                    continue
                whole.zero_()
            if target.is_contiguous():  # every entry was checked as it arrived (its crc32c too)
                codec.decode_add_(payload, target, alpha=weight, verified=True)
            else:
                got = codec.decode(payload, entry.region.sizes, verified=True)
                target.add_(weighted(got, weight))  # no fused w·Δ + acc
