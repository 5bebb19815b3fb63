"""The coordinator core's requests and answers: plain data, no protobuf.

``service.py`` converts the wire messages into these and back; the core and its tests never see
protobuf. Enum values name what happened, so no caller matches text.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import torch

from atoll.coordinator.config import RunConfig
from atoll.coordinator.regions import Region
from atoll.protos.vocabulary import PushKind, PushOutcome, UpdateKind

PARAMETER, BUFFER = "parameter", "buffer"
"""Tensor kinds: trained parameters take the outer optimizer; floating-point buffers are averaged."""


@dataclass(frozen=True)
class TensorDecl:
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype | None
    """None: a dtype the wire names but this build does not know."""
    kind: str = PARAMETER
    aliases: tuple[str, ...] = ()
    """Other names of the same tensor in the model's state_dict (tied weights)."""


@dataclass(frozen=True, kw_only=True)
class JoinRequest:
    run_id: str
    island_id: str
    session_id: str = ""
    codecs: tuple[str, ...] = ()
    tensors: tuple[TensorDecl, ...] = ()
    num_ranks: int = 1
    shard_index: int = 0
    num_shards: int = 1
    partition: str = "hash"
    layout_digest: str = ""
    model_card: str = ""
    """What the model is, as JSON (``JoinRequest.model_card``; empty: not said)."""


@dataclass(frozen=True, kw_only=True)
class JoinAnswer:
    config: RunConfig
    round: int
    bootstrap: bool
    codec: str
    run_complete: bool


@dataclass(frozen=True, kw_only=True)
class IslandCall:
    """Heartbeat and Leave: who is calling."""

    run_id: str
    island_id: str
    session_id: str = ""


@dataclass(frozen=True)
class EntryDecl:
    name: str
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    num_bytes: int


@dataclass(frozen=True, kw_only=True)
class PushHeader:
    run_id: str
    island_id: str
    session_id: str = ""
    round: int
    kind: PushKind | None
    """None: a kind this build does not know."""
    rank: int = 0
    num_ranks: int = 1
    tokens: int = 0
    codec: str = ""
    entries: tuple[EntryDecl, ...] = ()
    loss: float | None = None
    inner_steps: int = 0
    compute_seconds: float = 0.0
    blocked_seconds: float = 0.0


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
    regions: tuple[tuple[str, tuple[int, ...], tuple[int, ...]], ...] = ()
    """(name, offsets, sizes); empty offsets and sizes: the whole tensor; no regions: every tensor."""


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
