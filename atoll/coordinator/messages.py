"""The coordinator core's requests and answers: plain data, no protobuf.

``transport/convert.py`` converts the wire messages into these and back; the core and its tests never
see protobuf. The messages both ends speak (:class:`JoinRequest`, :class:`PushHeader`, their
:class:`TensorDecl` and :class:`Entry`) are :mod:`atoll.protos.messages`'s, re-exported here; the rest
are the core's own. Enum values name what happened, so no caller matches text.
"""

from __future__ import annotations

import warnings
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from atoll.coordinator.config import RunConfig
from atoll.protos.messages import Entry, JoinRequest, Member, PushHeader, Region, TensorDecl, TensorRegion
from atoll.protos.vocabulary import PushOutcome, TensorKind, UpdateKind

__all__ = [
    "Admission",
    "Entry",
    "IslandCall",
    "JoinRequest",
    "Member",
    "PayloadEntry",
    "PullAnswer",
    "PullRequest",
    "PushHeader",
    "PushResult",
    "Region",
    "TensorDecl",
    "TensorKind",
    "TensorRegion",
]

RENAMED = {
    "EntryDecl": ("Entry", Entry),
    "PARAMETER": ("TensorKind.PARAMETER", TensorKind.PARAMETER),
    "BUFFER": ("TensorKind.BUFFER", TensorKind.BUFFER),
}
"""Names of the last release, kept for one more (the coordinator's ``JoinAnswer`` is :class:`Admission`,
below)."""


def __getattr__(name: str):
    if name == "JoinAnswer":
        name, value = "Admission", Admission
    elif name in RENAMED:
        name, value = RENAMED[name]
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    warnings.warn(f"this name of atoll.coordinator.messages is deprecated: use {name}", FutureWarning, stacklevel=2)
    return value


@dataclass(frozen=True, kw_only=True)
class Admission:
    """What the core decides at Join; the service adds its transport's terms (bulk port, streams) and
    answers with the wire's JoinResponse."""

    config: RunConfig
    round: int
    bootstrap: bool
    codec: str
    run_complete: bool
    relay_chain: tuple[str, ...] = ()
    """This relay and the relays above it (empty: a root coordinator answers)."""


@dataclass(frozen=True, kw_only=True)
class IslandCall:
    """Heartbeat and Leave: who is calling."""

    run_id: str
    island_id: str
    session_id: str = ""


@dataclass(frozen=True)
class PushResult:
    outcome: PushOutcome
    round: int
    """The coordinator's open round."""
    committed: bool
    """Whether the island's contribution for the push's round is complete (also for a duplicate)."""
    bytes_received: int = 0
    carried: bool = False
    """ROUND_CLOSED for a delta too stale to fold: nothing was added, and its work is not lost: the island
    re-bases on the newest θ with its progress kept and carries it into its next push."""


@dataclass(frozen=True, kw_only=True)
class PullRequest:
    run_id: str
    island_id: str
    session_id: str = ""
    have_round: int
    wait_seconds: float = 0.0
    regions: tuple[TensorRegion, ...] = ()
    """No regions: every tensor whole."""


@dataclass
class PayloadEntry:
    """One entry of a pull answer. ``data`` is the payload, or a function that gives it when the entry
    is sent (large answers are encoded one entry at a time, so none is held whole): as one buffer, or
    as a list of buffers sent one after the other."""

    name: str
    region: Region | None
    num_bytes: int
    data: bytes | bytearray | memoryview | Callable[[], object]
    made: Callable[[], Awaitable[object]] | None = None
    """Awaited for the payload instead of ``data``: it is still being made (the outer step streams it)."""
    held: int = 0
    """Bytes its payload allocates when it is made (a copy of a region; 0: memory the coordinator holds)."""

    def payload(self):
        return self.data() if callable(self.data) else self.data

    def parts(self) -> list:
        """The payload as a list of buffers."""
        got = self.payload()
        return got if isinstance(got, list) else [got]


@dataclass
class PullAnswer:
    kind: UpdateKind
    round: int
    latest_round: int
    codec: str = "identity"
    entries: list[PayloadEntry] = field(default_factory=list)
    committed: bool = False
    loss: float | None = None
    bootstrap: bool = False
    run_complete: bool = False
    waiting: str = ""
    stalled: bool = False
    """NOT_READY: the open round cannot close as things stand (the quorum is gone)."""
    arrival_offset: float | None = None
    """DELTA or FULL, decoupled runs: where the island's fresh push landed in round ``round - 1``,
    seconds after the median of that round's fresh pushes (:mod:`atoll.coordinator.policy.phase`)."""
    durable: Callable[[], Awaitable[bool]] | None = None
    """A tentative update (its round still being saved): awaited after the entries are sent; True once
    the round is saved and published, False if it was not within the wait."""
    reservation: object | None = None
    """Its share of the pull budget (a ``budget.Reservation``), held until the stream ends: :meth:`done`."""
    leases: list = field(default_factory=list)
    """Its leases (``atoll.memory.Lease``) on what its entries read (θ's tensors, the update's payloads):
    none of it is handed out again while the answer streams."""

    def done(self) -> None:
        """The answer was streamed (or its stream broke): its memory goes back to the pull budget and
        what it read may be reused."""
        if self.reservation is not None:
            self.reservation.release()
            self.reservation = None
        for lease in self.leases:
            lease.release()
        self.leases = []
