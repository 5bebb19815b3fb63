"""The protocol's messages as plain data, one type for each, spoken by both ends.

An island builds these and its transport (:mod:`atoll.islands._transport.convert`) writes them as
atoll.v1's protobuf; the coordinator's service (:mod:`atoll.coordinator.transport.convert`) reads the
protobuf into the same types, and its core never sees protobuf. What only one end holds has a name of its
own there: the coordinator's :class:`~atoll.coordinator.messages.Admission` (what it decides at Join) and
:class:`~atoll.coordinator.messages.PullAnswer`; the island's
:class:`~atoll.islands._messages.JoinAnswer` (what it hears back) and
:class:`~atoll.islands._messages.Update`.

Who calls (``run_id``, ``island_id``, ``session_id``, ``rank``, ``num_ranks``) is part of the wire's
messages. An island's algorithm leaves them empty: its transport writes them from the session's
:class:`~atoll.islands._messages.Identity`, so they are said in one place.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from atoll.protos.vocabulary import PushKind, TensorKind


@dataclass(frozen=True)
class Region:
    """A region of a global tensor: the piece of it one rank's shard covers."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]

    @classmethod
    def full(cls, shape: tuple[int, ...]) -> Region:
        return cls(tuple(0 for _ in shape), tuple(shape))

    @classmethod
    def parse(cls, offsets, sizes, shape: tuple[int, ...]) -> Region:
        """Validate a region sent on the wire against the tensor's shape (empty = whole tensor)."""
        offsets, sizes = tuple(int(o) for o in offsets), tuple(int(s) for s in sizes)
        if not offsets and not sizes:
            return cls.full(shape)
        if len(offsets) != len(shape) or len(sizes) != len(shape):
            raise ValueError(
                f"region has {len(offsets)} offsets and {len(sizes)} sizes for a tensor of {len(shape)} dims"
            )
        for dim, (o, s, n) in enumerate(zip(offsets, sizes, shape, strict=True)):
            if o < 0 or s < 0 or o + s > n:
                raise ValueError(f"region [{o}, {o + s}) is outside dim {dim} of size {n}")
        return cls(offsets, sizes)

    @property
    def numel(self) -> int:
        return math.prod(self.sizes)

    def slices(self) -> tuple[slice, ...]:
        return tuple(slice(o, o + s) for o, s in zip(self.offsets, self.sizes, strict=True))

    def overlaps(self, other: Region) -> bool:
        return (
            all(
                a < b + sb and b < a + sa
                for a, sa, b, sb in zip(self.offsets, self.sizes, other.offsets, other.sizes, strict=True)
            )
            and self.numel > 0
            and other.numel > 0
        )


@dataclass(frozen=True)
class TensorRegion:
    """A tensor's region, by name, as a pull asks for it (empty offsets and sizes: all of it)."""

    name: str
    offsets: tuple[int, ...] = ()
    sizes: tuple[int, ...] = ()


@dataclass(frozen=True)
class Entry:
    """One entry of a push or of an update: a tensor's region and its payload's bytes (empty offsets
    and sizes: the whole tensor)."""

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
    dtype: torch.dtype | None
    """None: a dtype the wire names but this build does not know (the coordinator refuses it)."""
    kind: TensorKind | None = TensorKind.PARAMETER
    """None: a kind this build does not know."""
    aliases: tuple[str, ...] = ()
    """Its other names in the model's state_dict (tied weights)."""


@dataclass(frozen=True)
class Member:
    """One island behind a relay, as the relay's push reports it (the root weighs and checks each)."""

    island_id: str
    tokens: int = 0
    inner_steps: int = 0
    loss: float | None = None
    compute_seconds: float = 0.0
    via: str = ""
    """The relays between the pushing relay and the island, '/'-joined, outermost first ("": none)."""
    joined_seconds: float = 0.0
    """How long the island had been joined at its own relay when that relay pushed (its goodput's wall)."""

    def named(self, relay: str) -> str:
        """The island's name in the root's record: the relays it came through, then its id."""
        return "/".join(x for x in (relay, self.via, self.island_id) if x)

    def to_json(self) -> list:
        return [self.island_id, self.tokens, self.inner_steps, self.loss, self.compute_seconds, self.via,
                self.joined_seconds]  # fmt: skip

    @classmethod
    def from_json(cls, d: list) -> Member:
        via, joined = (str(d[5]) if len(d) > 5 else ""), (float(d[6]) if len(d) > 6 else 0.0)
        return cls(str(d[0]), int(d[1]), int(d[2]), d[3], float(d[4]), via, joined)


@dataclass(frozen=True, kw_only=True)
class JoinRequest:
    """What an island joins one coordinator shard with."""

    run_id: str = ""
    island_id: str = ""
    session_id: str = ""
    codecs: tuple[str, ...] = ()
    tensors: tuple[TensorDecl, ...] = ()
    num_ranks: int = 1
    shard_index: int = 0
    num_shards: int = 1
    partition: str = "hash"
    layout_digest: str = ""
    model_card: str = ""
    """What the model is, as JSON (empty: not said)."""
    relay: bool = False
    """The joiner is a relay (``atoll relay``): its pushes sum its islands' (:attr:`PushHeader.members`)."""


@dataclass(frozen=True, kw_only=True)
class PushHeader:
    """A push of one rank: what its stream carries."""

    run_id: str = ""
    island_id: str = ""
    session_id: str = ""
    rank: int = 0
    num_ranks: int = 1
    kind: PushKind | None
    """None: a kind this build does not know (the coordinator refuses it)."""
    round: int
    codec: str = ""
    entries: tuple[Entry, ...] = ()
    tokens: int = 0
    loss: float | None = None
    inner_steps: int = 0
    compute_seconds: float = 0.0
    blocked_seconds: float = 0.0
    members: tuple[Member, ...] = ()
    """A relay's push: the islands whose token-weighted mean its payload is (empty: an island's own)."""

    def to_json(self) -> dict:
        """What the push says, as plain JSON values (an island's checkpoint; who calls is not kept)."""
        assert self.kind is not None
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
            **({"members": [m.to_json() for m in self.members]} if self.members else {}),
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
            members=tuple(Member.from_json(m) for m in d.get("members", ())),
        )
