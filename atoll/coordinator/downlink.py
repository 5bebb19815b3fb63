"""What islands pull: outer updates and the full θ, built so memory does not grow with islands or rounds.

- The latest outer update stays in memory, encoded (every island pulls it right after a round),
  until the next round's outer step needs the room; it is also written to the state dir in the
  background as soon as it is published.
- Older ones, up to ``window`` rounds back, are read from the state dir when an island that fell
  behind asks. Those files are a cache: written without fsync, checked by each payload's CRC when
  read; one that is missing or damaged only means a full θ for an island that far behind.
- A full θ (an island joining, or too far behind) and any region of a tensor are encoded one entry
  at a time while the answer streams: no copy of θ is cached.
"""

from __future__ import annotations

import logging
import math
import threading
from pathlib import Path

import torch

from atoll.compression import codec_of, get_codec, wire
from atoll.compression.wire import payload_size
from atoll.coordinator import persistence
from atoll.coordinator.messages import PayloadEntry
from atoll.coordinator.regions import Region

log = logging.getLogger("atoll.coordinator")

IDENTITY_ID = get_codec("identity").codec_id
UPDATES_KEPT = 8
"""Outer updates kept: an island up to this many rounds behind catches up by exact deltas."""

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


class Downlink:
    def __init__(self, state_dir: Path, window: int = UPDATES_KEPT) -> None:
        self.state_dir = Path(state_dir)
        self.window = window
        self.latest_round: int | None = None
        """θ_latest_round = θ_(latest_round - 1) + decode(latest)."""
        self.latest: dict | None = {}
        """The latest update's payloads, or None once only the state dir has them."""
        self._writer: threading.Thread | None = None
        self._written = False

    def publish(self, round_: int, payloads: dict[str, bytearray]) -> None:
        """The new latest update: served from memory, written to the state dir in the background."""
        self._wait_written()
        self.latest_round, self.latest, self._written = round_, payloads, False
        self._writer = threading.Thread(
            target=self._write, args=(round_, payloads), name="atoll-update-writer", daemon=True
        )
        self._writer.start()

    def _write(self, round_: int, payloads: dict) -> None:
        try:
            persistence.save_update(self.state_dir, round_, payloads, keep_from=self.keep_from(round_), durable=False)
            self._written = True
        except Exception as err:  # a cache: islands that far behind get the full θ instead
            log.warning("could not keep the update of round %d for catch-up: %s", round_, err)

    def _wait_written(self) -> None:
        if self._writer is not None:
            self._writer.join()
            self._writer = None

    def close(self) -> None:
        """Wait for the update being written (the server is stopping)."""
        self._wait_written()

    def release_latest(self, wait: bool = True) -> None:
        """Drop the latest update from memory (the next outer step needs the room, or every live
        island has it): it is then served from the state dir, if it was written there. ``wait``: for
        the write in progress; without it nothing happens until the write is done."""
        if wait:
            self._wait_written()
        elif self._writer is not None and self._writer.is_alive():
            return
        if self._written:
            self.latest = None

    def restore(self, round_: int) -> None:
        """After a restart: the latest update is the kept one of ``round_``, if any."""
        kept = persistence.load_update(self.state_dir, round_)
        if kept is not None:
            self.latest_round, self.latest, self._written = round_, kept, True

    def keep_from(self, round_: int) -> int:
        """The oldest round whose update is kept once θ_round is published."""
        return round_ - self.window + 1

    def can_catch_up(self, have_round: int, round_: int) -> bool:
        """Whether an island holding θ_have can reach θ_round by exact deltas."""
        return self.latest_round == round_ and 0 <= have_round < round_ and have_round + 1 >= self.keep_from(round_)

    def delta_entries(self, round_: int, regions: Regions, specs: dict[str, tuple[int, ...]]) -> list[PayloadEntry]:
        """The update that produced θ_round: whole tensors as encoded, regions as exact identity slices
        of the decoded tensor (decoded per entry, when it is sent)."""
        in_memory = round_ == self.latest_round and self.latest is not None
        payloads = self.latest if in_memory else persistence.load_update(self.state_dir, round_)
        if payloads is None:
            raise LookupError(f"the update of round {round_} is not kept")
        out = []
        for name, region in regions:
            payload = payloads[name]
            if region is None:
                out.append(PayloadEntry(name, None, len(payload), payload))
                continue

            def sliced(payload=payload, shape=specs[name], region=region):
                whole = codec_of(payload).decode(payload, shape)
                return get_codec("identity").encode(whole[region.slices()].contiguous())

            out.append(PayloadEntry(name, region, identity_size(region.sizes), sliced))
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
            )
            for name, region in regions
        ]
