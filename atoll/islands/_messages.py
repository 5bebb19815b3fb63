"""What an island says to the coordinator and hears back, as plain data: the island's algorithm
(:mod:`~atoll.islands._route_table`, :mod:`~atoll.islands._exchanges`, :mod:`~atoll.islands._resume`)
speaks these; only its transport (:mod:`atoll.islands._transport`) knows their protobuf form. What both
ends say (:class:`JoinRequest`, :class:`PushHeader`, :class:`TensorDecl`, :class:`Entry`,
:class:`TensorRegion`) is :mod:`atoll.protos.messages`'s, re-exported here; what only the island hears
(:class:`JoinAnswer`, :class:`Update`) is defined here. Enum values name what happened, so nothing is
matched by text.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from atoll.protos.messages import Entry, JoinRequest, PushHeader, TensorDecl, TensorRegion
from atoll.protos.vocabulary import UpdateKind

__all__ = [
    "Entry",
    "Identity",
    "JoinAnswer",
    "JoinRequest",
    "Pulled",
    "PushHeader",
    "RunTerms",
    "TensorDecl",
    "TensorRegion",
    "Update",
]


class Pulled(enum.Enum):
    """How a wait for an outer step ended (:meth:`Session.pull_until_ready`)."""

    DELTA = "UPDATE_KIND_DELTA"
    FULL = "UPDATE_KIND_FULL"
    NOT_READY = "NOT_READY"
    """The run completed with this island already holding its final θ."""
    BOOTSTRAPPED = "BOOTSTRAPPED"
    """The run's θ_0 is this island's own upload."""


@dataclass(frozen=True)
class Identity:
    """Who calls: the island's run, name, session (one process per island id) and this rank of it."""

    run_id: str
    island_id: str
    session_id: str
    rank: int
    num_ranks: int


@dataclass(frozen=True)
class RunTerms:
    """What of the run's configuration an island follows."""

    sync_every: int
    outer_mode: str
    max_staleness: int
    error_feedback: bool
    error_feedback_decay: float


@dataclass(frozen=True)
class JoinAnswer:
    """What an island hears back from Join (the wire's JoinResponse: the coordinator's
    :class:`~atoll.coordinator.messages.Admission` and its transport's terms)."""

    round: int
    bootstrap: bool
    """The island holds the claim to upload θ_0."""
    codec: str
    """The run's codec spec, the island pushes with."""
    run_complete: bool
    run: RunTerms
    bulk_port: int = 0
    checks_tokens: bool = False
    relay_chain: tuple[str, ...] = ()
    """The relays between this joiner and the root, the one answering first (empty: the root answered)."""
    config: dict = field(default_factory=dict)
    """The run's whole configuration, field by field as plain values (a relay serves the same run)."""


@dataclass(frozen=True)
class Update:
    """An answer to a pull: the outer update past a round, the full θ, or NOT_READY with why."""

    kind: UpdateKind
    round: int
    """The version the island holds after applying it (or the open round if NOT_READY)."""
    codec: str = "identity"
    entries: tuple[Entry, ...] = field(default_factory=tuple)
    committed: bool = False
    loss: float | None = None
    latest_round: int = 0
    bootstrap: bool = False
    run_complete: bool = False
    waiting: str = ""
    stalled: bool = False
    tentative: bool = False
    arrival_offset: float | None = None
    """Decoupled runs, with an update: where this island's push landed in round ``round - 1``, seconds
    after the median of its fresh pushes (None: its push was not one of them)."""
