"""What a push is while the coordinator holds it: its plan (what its stream must contain), the entries
received and validated so far, its staged ranks, and the record of a contribution that counted.

The accumulator (:mod:`atoll.coordinator.state.accumulator`) stages an island's ranks until its last
one is in; each rank's bytes are held against the in-flight budget
(:mod:`atoll.coordinator.state.budget`): memory follows the bytes received, never the sizes declared.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from atoll.coordinator.regions import Region
from atoll.coordinator.state.budget import Reservation
from atoll.protos.messages import Member


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
    members: tuple[Member, ...] = ()
    """A relay's push: the islands its payload sums (empty: an island's own push)."""

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
    decode_seconds: float = 0.0
    """What decoding it into the round's sum took (the core's lock held: pushes decode one at a time)."""
    members: tuple[Member, ...] = ()
    """A relay's contribution: the islands behind it (their tokens and steps are counted one by one)."""
    entered: float | None = None
    """A relay's: Σ w_i s_i of its members (decoupled step scales; None: weight x its own scale)."""


@dataclass
class HeldPush:
    """A committed contribution kept out of the round's sum until its turn (see
    :mod:`~atoll.coordinator.policy.order`): its ranks (their payloads and reservations), its weight."""

    ranks: list[StagedRank]
    weight: float


def release(ranks) -> None:
    for staged in ranks:
        if staged.reservation is not None:
            staged.reservation.release()
