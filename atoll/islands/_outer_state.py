"""The island's outer state: one owner for every local shard's :class:`~atoll.islands._shard_state.ShardState`
(θ at the round's start, error feedback, a snapshot while overlapping), the leases on their push
payloads and the devices' staging, and the one checked path by which pulled updates change them.

The exchanges and DiLoCo sequence calls on it by route (the shards a route holds, from the
:class:`~atoll.islands._route_table.RouteTable`); nothing outside reaches into its states.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

import torch

from atoll.compression import codec_of
from atoll.compression.staging import DeviceStaging
from atoll.islands._messages import Update
from atoll.islands._options import DiLoCoOptions
from atoll.islands._shard_state import Placement, ShardState
from atoll.islands._shards import LocalShard
from atoll.memory import Leases
from atoll.protos.vocabulary import UpdateKind


class OuterState:
    def __init__(self, shards: list[LocalShard], options: DiLoCoOptions) -> None:
        """One state per local shard, its outer state placed as ``options.outer_state`` says and its
        payloads staged through the device when ``options.staged_copies`` (one placement and one staging
        per device)."""
        placements: dict[torch.device, Placement] = {}
        stagings: dict[torch.device, DeviceStaging] = {}
        self.leases = Leases()
        """Who reads the shards' push payloads now (see :meth:`ShardState.encode`)."""
        self._states: dict[tuple, ShardState] = {}
        for s in shards:
            device = s.local().device
            placement = placements.setdefault(device, Placement(options.outer_state, device))
            staging = stagings.setdefault(device, DeviceStaging(device, enabled=options.staged_copies))
            self._states[s.key] = ShardState(s, placement, self.leases, staging if staging.enabled else None)
        self.stagings = [st for st in stagings.values() if st.enabled]
        """The devices whose payloads are staged: a payload is read only once :meth:`on_host` says so."""

    @property
    def on_cuda(self) -> bool:
        """Some payloads are staged from a CUDA device (pulled entries then land in pinned memory)."""
        return any(st.cuda for st in self.stagings)

    def of(self, shard: LocalShard) -> ShardState:
        return self._states[shard.key]

    def items(self) -> Iterator[tuple[tuple, ShardState]]:
        """(key, state) of every local shard (a checkpoint's)."""
        return iter(self._states.items())

    # ---- pushes ----------------------------------------------------------------------------------
    def encode(self, shards: Iterable[LocalShard], codec) -> list:
        """The shards' pseudo-gradients, encoded (on the parameters' device; payloads on the host)."""
        return [self._states[s.key].encode(codec) for s in shards]

    def encoder(self, shards: list[LocalShard], codec) -> Callable[[int], object]:
        """``encode(j)``: the j-th shard's pseudo-gradient, encoded when the push stream asks, on the host."""
        return lambda j: self.on_host([self._states[shards[j].key].encode(codec)])[0]

    def on_host(self, payloads: list) -> list:
        """``payloads`` on the host and sealed: a staged encode returns before its copy to the host is
        done; whoever reads the bytes (the push's I/O) waits for that copy here, not the training thread."""
        for staging in self.stagings:
            for p in payloads:
                staging.settle(p)
        return payloads

    def take_snapshots(self, shards: Iterable[LocalShard]) -> None:
        """θ now, kept: the progress made from here on survives the update (overlap, decoupled)."""
        for s in shards:
            self._states[s.key].take_snapshot()

    def keep_base(self, shards: Iterable[LocalShard]) -> None:
        """The push was dropped: re-base on the new θ with the round's progress kept."""
        for s in shards:
            self._states[s.key].keep_base()

    # ---- updates: the one checked path -----------------------------------------------------------
    def applier(self, shards: Iterable[LocalShard]) -> Callable[[Update, int, object], None]:
        """``on_entry(header, i, payload)``: apply one pulled entry to its shard as soon as it arrives."""
        by_key = _by_entry_key(shards)

        def apply(header: Update, i: int, payload) -> None:
            self.apply_checked([(_shard_for(by_key, header.entries[i]), payload, header.kind is UpdateKind.FULL)])

        return apply

    def apply_all(self, shards: Iterable[LocalShard], updates: list) -> None:
        """Advance the shards' θ_start by each ``(header, payloads)``, in order: every payload is checked
        before any is applied, so a corrupt update changes nothing."""
        shards = list(shards)
        plans = []
        for header, payloads in updates:
            by_key = {e.key: payload for e, (_, payload) in zip(header.entries, payloads, strict=True)}
            for s in shards:
                key = _entry_key(s)
                if key not in by_key:
                    raise RuntimeError(f"update is missing tensor {s.name!r} region {s.offsets}+{s.sizes}")
                plans.append((s, by_key[key], header.kind is UpdateKind.FULL))
        self.apply_checked(plans)

    def apply_checked(self, plans: list[tuple[LocalShard, object, bool]]) -> None:
        """Each ``(shard, payload, full)``'s payload checked against its shard (WireFormatError before
        anything changes), then applied: the one way an update reaches the outer state."""
        for s, payload, _ in plans:
            codec_of(payload).frame(payload, s.sizes)
        for s, payload, full in plans:
            self._states[s.key].apply(payload, full, verified=True)

    # ---- θ into the model ------------------------------------------------------------------------
    def load_params(self, shards: Iterable[LocalShard], merge: bool) -> None:
        """The shards' θ_start into the model (``merge``: keeping the progress since the snapshot)."""
        for s in shards:
            self._states[s.key].load_into_param(merge)

    def start_from_local(self, shards: Iterable[LocalShard]) -> None:
        """θ_start is the model's own θ (the run's θ_0 is this rank's upload)."""
        for s in shards:
            self._states[s.key].start_from_local()


def _entry_key(s: LocalShard) -> tuple:
    """How an update names ``s``'s region: a whole tensor by its name alone."""
    return (s.name, (), ()) if s.is_full else s.key


def _by_entry_key(shards: Iterable[LocalShard]) -> dict[tuple, LocalShard]:
    return {_entry_key(s): s for s in shards}


def _shard_for(by_key: dict[tuple, LocalShard], e) -> LocalShard:
    s = by_key.get(e.key)
    if s is None:
        raise RuntimeError(f"update entry {e.name!r} {list(e.offsets)}+{list(e.sizes)} is no region of this rank")
    return s
