"""What an island says to the coordinator and hears back, as plain data: the island's algorithm
(:mod:`~atoll.islands._routes`, :mod:`~atoll.islands._exchanges`, :mod:`~atoll.islands._resume`) speaks
these; only its transport (:mod:`atoll.islands._transport`) knows their protobuf form. Enum values name
what happened, so nothing is matched by text.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch

from atoll.protos.vocabulary import PushKind, UpdateKind


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
class Region:
    """A tensor's region, by name and its place in the whole (empty offsets and sizes: all of it)."""

    name: str
    offsets: tuple[int, ...] = ()
    sizes: tuple[int, ...] = ()


@dataclass(frozen=True)
class Entry:
    """One entry of a push or of an update: a region and its payload's bytes."""

    name: str
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    num_bytes: int

    @property
    def key(self) -> tuple[str, tuple[int, ...], tuple[int, ...]]:
        return self.name, self.offsets, self.sizes


@dataclass(frozen=True)
class TensorDecl:
    """A tensor of the island's model, as it declares it at Join."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    buffer: bool = False
    """A floating-point buffer (averaged over the islands, no outer momentum)."""
    aliases: tuple[str, ...] = ()
    """Its other names in the model's state_dict (tied weights)."""


@dataclass(frozen=True)
class JoinRequest:
    """What an island joins one coordinator shard with (its identity is the session's)."""

    codecs: tuple[str, ...]
    tensors: tuple[TensorDecl, ...]
    num_ranks: int
    shard_index: int
    num_shards: int
    partition: str
    layout_digest: str = ""
    model_card: str = ""


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
    round: int
    bootstrap: bool
    """The island holds the claim to upload θ_0."""
    codec: str
    """The run's codec spec, the island pushes with."""
    run_complete: bool
    run: RunTerms
    bulk_port: int = 0
    checks_tokens: bool = False


@dataclass
class PushHeader:
    """A push of one rank: what its stream carries (its identity is the session's)."""

    kind: PushKind
    round: int
    codec: str
    entries: tuple[Entry, ...]
    tokens: int = 0
    loss: float | None = None
    inner_steps: int = 0
    compute_seconds: float = 0.0
    blocked_seconds: float = 0.0

    def to_json(self) -> dict:
        """As plain JSON values (for a checkpoint)."""
        return {
            "kind": self.kind.value,
            "round": self.round,
            "codec": self.codec,
            "entries": [[e.name, list(e.offsets), list(e.sizes), e.num_bytes] for e in self.entries],
            "tokens": self.tokens,
            "loss": self.loss,
            "inner_steps": self.inner_steps,
            "compute_seconds": self.compute_seconds,
            "blocked_seconds": self.blocked_seconds,
        }

    @classmethod
    def from_json(cls, d: dict) -> PushHeader:
        return cls(
            kind=PushKind(d["kind"]),
            round=int(d["round"]),
            codec=d["codec"],
            entries=tuple(Entry(n, tuple(o), tuple(s), int(b)) for n, o, s, b in d["entries"]),
            tokens=int(d["tokens"]),
            loss=d["loss"],
            inner_steps=int(d["inner_steps"]),
            compute_seconds=float(d["compute_seconds"]),
            blocked_seconds=float(d["blocked_seconds"]),
        )


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
