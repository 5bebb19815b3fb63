"""What islands pull: outer updates and the full θ, built so memory does not grow with islands or rounds.

- The latest outer update stays in memory, encoded (every island pulls it right after a round),
  until the next round's outer step needs the room. It is already on disk: a round's update is its
  log record (:mod:`atoll.coordinator.disk.wal`), written before the round is published.
- Older ones, up to ``window`` rounds back, are read from the log when an island that fell behind
  asks; one that is missing or damaged only means a full θ for an island that far behind.
- A full θ (an island joining, or too far behind) and any region of a tensor are encoded one entry
  at a time while the answer streams: no copy of θ is cached.

What a pull holds while it streams (the copies it makes, an update read from the log, and what its
transport buffers while the peer reads) is reserved from the pull budget when its answer is made,
before any of its data flows, or the pull is refused (PULL_BUDGET; islands retry): a peer that never
reads its answer holds no more than that, until the stream's idle limit ends it.
"""

from __future__ import annotations

import contextlib
import math
from pathlib import Path

import torch

from atoll.compression import codec_of, get_codec, wire
from atoll.compression.wire import payload_size
from atoll.coordinator.disk import wal
from atoll.coordinator.errors import Reason
from atoll.coordinator.messages import PayloadEntry
from atoll.coordinator.regions import Region
from atoll.coordinator.state.budget import InflightBudget, Reservation

IDENTITY_ID = get_codec("identity").codec_id
UPDATES_KEPT = 8
"""Outer updates kept: an island up to this many rounds behind catches up by exact deltas."""
MIN_PULL_BYTES = 256 << 20
TRANSPORT_BYTES = 4 << 20
"""What a pull's transport holds while its peer reads, counted with every answer that carries data:
gRPC buffered ~5 messages of 1 MiB per stream whose client stopped reading (HTTP/2 flow control)."""

Regions = list[tuple[str, Region | None]]


def identity_size(shape: tuple[int, ...]) -> int:
    """Bytes of the identity (fp32) payload of a tensor of ``shape``."""
    return payload_size(len(shape), 0, 4 * math.prod(shape))


def _identity_of(tensor: torch.Tensor, region: Region | None):
    """A function that gives the identity payload of ``tensor`` (or its region) when called: a whole
    tensor as [head, its own memory, crc] (θ_r is never written in place: the outer step builds
    θ_{r+1} in other tensors), a region as a copy of just that region."""
    if region is None:
        return lambda: wire.parts(IDENTITY_ID, torch.float32, tuple(tensor.shape), b"", tensor.contiguous().numpy())
    return lambda: get_codec("identity").encode(tensor[region.slices()].contiguous())


def region_copy(shape: tuple[int, ...], region: Region) -> int:
    """Bytes a region of an update takes to send: the tensor decoded whole, then the region's payload."""
    return identity_size(shape) + identity_size(region.sizes)


class Downlink:
    def __init__(self, state_dir: Path, window: int = UPDATES_KEPT, max_pull_bytes: int = 0) -> None:
        """``max_pull_bytes``: the memory pulls may hold at once (0: two whole fp32 copies of the model,
        at least 256 MiB, see :meth:`size_budget`)."""
        self.state_dir = Path(state_dir)
        self.window = window
        self.budget = InflightBudget(max_pull_bytes or MIN_PULL_BYTES, Reason.PULL_BUDGET, "pull memory")
        self._budget_from_model = not max_pull_bytes
        self.latest_round: int | None = None
        """θ_latest_round = θ_(latest_round - 1) + decode(latest)."""
        self.latest: dict | None = {}
        """The latest update's payloads, or None once only the log has them."""

    def size_budget(self, specs: dict[str, tuple[int, ...]]) -> None:
        """The default pull budget: two whole fp32 copies of the model (at least 256 MiB)."""
        if self._budget_from_model:
            self.budget.limit = max(MIN_PULL_BYTES, 2 * sum(identity_size(s) for s in specs.values()))

    def reserve(self, entries: list[PayloadEntry]) -> Reservation:
        """Room for an answer of ``entries`` (made one at a time: the largest one's copies, and the
        transport's share), or PULL_BUDGET before any of its data flows."""
        return self._reserve(max((e.held for e in entries), default=0))

    def reserve_delta(self, round_: int, regions: Regions, specs: dict[str, tuple[int, ...]]) -> Reservation:
        """Room for the update that produced θ_round, before it is read from the log (a record read for
        one pull is held until it ends): its regions' copies, the record when it is not in memory, and
        the transport's share; or PULL_BUDGET."""
        copies = max((region_copy(specs[n], r) for n, r in regions if r is not None), default=0)
        record = 0
        if round_ != self.latest_round or self.latest is None:
            with contextlib.suppress(OSError):  # not kept: delta_entries says so
                record = (self.state_dir / wal.LOG / wal.record_name(round_ - 1)).stat().st_size
        return self._reserve(copies + record)

    def _reserve(self, num_bytes: int) -> Reservation:
        reservation = Reservation(self.budget)
        reservation.add(num_bytes + TRANSPORT_BYTES)
        return reservation

    def publish(self, round_: int, payloads: dict) -> None:
        """The new latest update (its log record is written): served from memory."""
        self.latest_round, self.latest = round_, payloads

    def release_latest(self) -> None:
        """Drop the latest update from memory (the next outer step needs the room, or every live
        island has it): it is then served from the log."""
        self.latest = None

    def in_memory(self, round_: int) -> dict | None:
        """The payloads of the update that produced θ_round, when they are in memory (None: the log's)."""
        return self.latest if round_ == self.latest_round and self.latest is not None else None

    def restore(self, round_: int) -> None:
        """After a restart: the latest update is the logged one that produced θ_round_, if kept."""
        kept = wal.load_update(self.state_dir, round_)
        if kept is not None:
            self.latest_round, self.latest = round_, kept

    def keep_from(self, round_: int) -> int:
        """The oldest round whose update is kept once θ_round is published."""
        return round_ - self.window + 1

    def can_catch_up(self, have_round: int, round_: int) -> bool:
        """Whether an island holding θ_have can reach θ_round by exact deltas."""
        return self.latest_round == round_ and 0 <= have_round < round_ and have_round + 1 >= self.keep_from(round_)

    def catch_up_pays(
        self, have_round: int, round_: int, regions: Regions, specs: dict[str, tuple[int, ...]], codec: str
    ) -> bool:
        """Whether the chain of updates from θ_have to θ_round moves fewer bytes than one full θ (the
        regions asked for, fp32): an island far enough behind gets θ itself, never more than one θ's
        bytes. Every round's update has the downlink ``codec``'s size; a region of one goes as an exact
        fp32 slice, so an island holding a region catches up by deltas only one round behind."""
        down = get_codec(codec)
        per_round = sum(down.encoded_size(specs[n]) if r is None else identity_size(r.sizes) for n, r in regions)
        full = sum(identity_size(specs[n] if r is None else r.sizes) for n, r in regions)
        return (round_ - have_round) * per_round <= full

    def delta_entries(self, round_: int, regions: Regions, specs: dict[str, tuple[int, ...]]) -> list[PayloadEntry]:
        """The update that produced θ_round: whole tensors as encoded, regions as exact identity slices
        of the decoded tensor (decoded per entry, when it is sent)."""
        payloads = self.in_memory(round_) or wal.load_update(self.state_dir, round_)
        if payloads is None:
            raise LookupError(f"the update of round {round_} is not kept")
        return self.entries_of(payloads, regions, specs)

    @staticmethod
    def entries_of(payloads: dict, regions: Regions, specs: dict[str, tuple[int, ...]]) -> list[PayloadEntry]:
        """An update's entries: whole tensors as encoded, regions as exact identity slices."""
        out = []
        for name, region in regions:
            payload = payloads[name]
            if region is None:
                out.append(PayloadEntry(name, None, len(payload), payload))
                continue

            def sliced(payload=payload, shape=specs[name], region=region):
                whole = codec_of(payload).decode(payload, shape)
                return get_codec("identity").encode(whole[region.slices()].contiguous())

            out.append(
                PayloadEntry(name, region, identity_size(region.sizes), sliced, held=region_copy(specs[name], region))
            )
        return out

    @staticmethod
    def full_entries(params: dict[str, torch.Tensor], regions: Regions) -> list[PayloadEntry]:
        """θ (or regions of it) in fp32, each entry encoded when it is sent."""
        return [
            PayloadEntry(
                name,
                region,
                identity_size(tuple(params[name].shape) if region is None else region.sizes),
                _identity_of(params[name], region),
                held=0 if region is None else identity_size(region.sizes),  # a region is a copy
            )
            for name, region in regions
        ]
