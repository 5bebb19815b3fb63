"""What islands pull: outer updates and the full θ, built so memory does not grow with islands or rounds.

- The latest outer update stays in memory, encoded (every island pulls it right after a round).
- Older ones, up to ``window`` rounds back, are read from the state dir when an island that fell
  behind asks (``persistence.save_update`` wrote them before the round was published).
- A full θ (an island joining, or too far behind) and any region of a tensor are encoded one entry
  at a time while the answer streams: no copy of θ is cached.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

from atoll.compression import codec_of, get_codec
from atoll.compression.wire import payload_size
from atoll.coordinator import persistence
from atoll.coordinator.messages import PayloadEntry
from atoll.coordinator.regions import Region

UPDATES_KEPT = 8
"""Outer updates kept: an island up to this many rounds behind catches up by exact deltas."""

Regions = list[tuple[str, Region | None]]


def identity_size(shape: tuple[int, ...]) -> int:
    """Bytes of the identity (fp32) payload of a tensor of ``shape``."""
    return payload_size(len(shape), 0, 4 * math.prod(shape))


def _identity_of(tensor: torch.Tensor, region: Region | None):
    """A function that encodes ``tensor`` (or its region) losslessly when called."""
    ident = get_codec("identity")
    if region is None:
        return lambda: ident.encode(tensor)
    return lambda: ident.encode(tensor[region.slices()].contiguous())


class Downlink:
    def __init__(self, state_dir: Path, window: int = UPDATES_KEPT) -> None:
        self.state_dir = Path(state_dir)
        self.window = window
        self.latest_round: int | None = None
        """θ_latest_round = θ_(latest_round - 1) + decode(latest)."""
        self.latest: dict[str, bytearray] = {}

    def publish(self, round_: int, payloads: dict[str, bytearray]) -> None:
        self.latest_round, self.latest = round_, payloads

    def restore(self, round_: int) -> None:
        """After a restart: the latest update is the kept one of ``round_``, if any."""
        kept = persistence.load_update(self.state_dir, round_)
        if kept is not None:
            self.publish(round_, kept)

    def keep_from(self, round_: int) -> int:
        """The oldest round whose update is kept once θ_round is published."""
        return round_ - self.window + 1

    def can_catch_up(self, have_round: int, round_: int) -> bool:
        """Whether an island holding θ_have can reach θ_round by exact deltas."""
        return self.latest_round == round_ and 0 <= have_round < round_ and have_round + 1 >= self.keep_from(round_)

    def delta_entries(self, round_: int, regions: Regions, specs: dict[str, tuple[int, ...]]) -> list[PayloadEntry]:
        """The update that produced θ_round: whole tensors as encoded, regions as exact identity slices
        of the decoded tensor (decoded per entry, when it is sent)."""
        payloads = self.latest if round_ == self.latest_round else persistence.load_update(self.state_dir, round_)
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
