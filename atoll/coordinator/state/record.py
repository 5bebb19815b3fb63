"""A closed round's record, typed and versioned: what the ledger keeps of each round, what its log
record and every snapshot store (as JSON), and what ``/api/status`` shows.

:meth:`RoundRecord.to_json` is the stored form (``version`` says which); :meth:`RoundRecord.from_json`
loads every form stored so far: a record of an earlier release (no ``version``) takes the defaults
for what it lacks, and keys this release does not know are kept and written back unchanged. It also
reads as a mapping (``rec["loss"]``, ``dict(rec)``), as the untyped records did, for readers written
against them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

RECORD_VERSION = 1
"""1: the first typed form (the untyped records before it read as version 0)."""

_OPTIONAL = ("share", "persist_seconds", "publish_seconds", "relayed", "sum_order")
"""Fields a record holds only sometimes (written when set)."""


@dataclass
class RoundRecord(Mapping):
    round: int
    islands: list[str] = field(default_factory=list)
    """The islands whose push committed for this round, sorted."""
    late: list[list] = field(default_factory=list)
    """[island, round] of each late delta folded into this round."""
    too_stale: list[list] = field(default_factory=list)
    """[island, round] of each delta that came too late to fold while this round was open (dropped)."""
    tokens: int = 0
    """Tokens of everything that entered θ this round (folded deltas included)."""
    tokens_by_island: dict[str, int] = field(default_factory=dict)
    steps_by_island: dict[str, int] = field(default_factory=dict)
    compute_seconds_by_island: dict[str, float] = field(default_factory=dict)
    bytes_by_island: dict[str, int] = field(default_factory=dict)
    loss: float | None = None
    """The committed islands' token-weighted mean training loss (None: none reported one)."""
    bytes_in: int = 0
    decode_seconds: float = 0.0
    """Seconds the decoding of the round's pushes into its sum took, all together."""
    states: dict[str, str] = field(default_factory=dict)
    """Every island's state when the round closed."""
    bytes_out_per_island: int = 0
    """Bytes of the encoded outer update (what each island pulls)."""
    reason: str = ""
    """Why the round closed when it did."""
    seconds_open: float = 0.0
    goodput: float | None = None
    """The run's goodput so far (None: not known yet)."""
    outer_step_seconds: float = 0.0
    share: float | None = None
    """Decoupled runs: the round's share of a round of everyone (None: a round of everyone)."""
    persist_seconds: float | None = None
    """Seconds the round took to be made durable (set once it was; not in its own log record)."""
    publish_seconds: float | None = None
    relayed: dict[str, str] | None = None
    """The islands whose work entered this round through a relay, each with that relay (None: none did)."""
    sum_order: str | None = None
    """``fixed``: the pushes entered the round's sum in the order of their islands' ids, whatever order
    they arrived in (θ_{r+1} has the same bits for the same pushes); ``arrival``: in some other order
    (:mod:`~atoll.coordinator.policy.order`). None: nothing was summed, or a record from before."""
    version: int = RECORD_VERSION
    extra: dict = field(default_factory=dict)
    """Keys of a stored record this release does not know, kept as they were."""

    # ---- the stored form ---------------------------------------------------------------------------
    def to_json(self) -> dict:
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "extra"}
        for name in _OPTIONAL:
            if out[name] is None:
                del out[name]
        out["version"] = RECORD_VERSION
        return {**self.extra, **out}

    @classmethod
    def from_json(cls, data: Mapping) -> RoundRecord:
        """A stored record of any release (ValueError when it has no round)."""
        if "round" not in data:
            raise ValueError("a round record without its round")
        names = {f.name for f in dataclasses.fields(cls)} - {"extra"}
        known = {k: v for k, v in data.items() if k in names}
        known.setdefault("version", 0)
        return cls(**known, extra={k: v for k, v in data.items() if k not in names})

    # ---- read as the untyped records were ---------------------------------------------------------
    def __getitem__(self, key: str):
        if key in self.extra:
            return self.extra[key]
        if key == "extra" or key not in self._present():
            raise KeyError(key)
        return getattr(self, key)

    def __iter__(self) -> Iterator[str]:
        return iter([*self._present(), *self.extra])

    def __len__(self) -> int:
        return len(self._present()) + len(self.extra)

    def _present(self) -> list[str]:
        return [
            f.name
            for f in dataclasses.fields(self)
            if f.name != "extra" and not (f.name in _OPTIONAL and getattr(self, f.name) is None)
        ]
