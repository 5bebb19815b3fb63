"""The island's outer state: one owner for every local shard's :class:`~atoll.islands._shard_state.ShardState`
(θ at the round's start, error feedback, a snapshot while overlapping), the leases on their push
payloads and the devices' staging, and the one checked path by which pulled updates change them.

The exchanges and DiLoCo sequence calls on it by route (the shards a route holds, from the
:class:`~atoll.islands._route_table.RouteTable`); nothing outside reaches into its states.
"""

from __future__ import annotations

import contextlib
import threading
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
        self._cuda = sorted({s.local().device for s in shards if s.local().device.type == "cuda"}, key=str)
        self._busy = threading.RLock() if self._cuda else contextlib.nullcontext()
        """Held by whoever encodes, applies, snapshots or merges on a CUDA device: the training thread,
        or an exchange's thread (overlap: the pushed θ's encoding and the update's arithmetic run
        there), one at a time, as they share the device's staging and placement (its side stream and
        its last write-back). Each shard's state is one flight's at a time, so on the CPU, where they
        share nothing, none waits (streaming fragments: the training thread never waits for another
        fragment's encoding)."""

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
    def encode(self, shards: Iterable[LocalShard], codec, *, pushed: bool = False) -> list:
        """The shards' pseudo-gradients, encoded (on the parameters' device; payloads on the host).
        ``pushed``: of θ as pushed, their snapshots (:meth:`take_snapshots`), on any thread."""
        with self._busy:
            return [self._states[s.key].encode(codec, pushed=pushed) for s in shards]

    def encoder(self, shards: list[LocalShard], codec) -> Callable[[int], object]:
        """``encode(j)``: the j-th shard's pseudo-gradient, encoded when the push stream asks, on the host."""
        return lambda j: self.on_host(self.encode([shards[j]], codec))[0]

    def on_host(self, payloads: list) -> list:
        """``payloads`` on the host and sealed: a staged encode returns before its copy to the host is
        done; whoever reads the bytes (the push's I/O) waits for that copy here, not the training thread."""
        for staging in self.stagings:
            for p in payloads:
                staging.settle(p)
        return payloads

    def take_snapshots(self, shards: Iterable[LocalShard]) -> None:
        """θ now, kept: the progress made from here on survives the update (overlap, decoupled)."""
        with self._busy:
            for s in shards:
                self._states[s.key].take_snapshot()

    def fence(self) -> Callable[[], None]:
        """What this thread has queued on its devices so far, for another thread to wait for before it
        reads the results (a snapshot's copy; a merge's delta): nothing to wait for on the CPU."""
        if not self._cuda or not torch.cuda.is_available():
            return lambda: None
        marks = [(d, torch.cuda.current_stream(d).record_event()) for d in self._cuda]

        def wait() -> None:
            for d, mark in marks:
                torch.cuda.current_stream(d).wait_event(mark)

        return wait

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
        self.apply_checked(_plans(shards, updates))

    def apply_checked(self, plans: list[tuple[LocalShard, object, bool]]) -> None:
        """Each ``(shard, payload, full)``'s payload checked against its shard (WireFormatError before
        anything changes), then applied: the one way an update reaches the outer state."""
        with self._busy:
            _check(plans)
            for s, payload, full in plans:
                self._states[s.key].apply(payload, full, verified=True)

    def prepare_merge(self, shards: Iterable[LocalShard], updates: list) -> None:
        """Overlap, on the exchange's thread once every update arrived: check them all (a corrupt one
        changes nothing), apply them to θ_start and make each shard's merge delta, θ_start − snapshot
        (:meth:`ShardState.prepare_merge`). The training thread then only adds the delta, in one pass
        (:meth:`load_params`)."""
        shards, plans = list(shards), _plans(shards, updates)
        with self._busy:
            _check(plans)
            for s in shards:
                self._states[s.key].prepare_merge([(p, full) for t, p, full in plans if t is s])

    # ---- θ into the model ------------------------------------------------------------------------
    def load_params(self, shards: Iterable[LocalShard], merge: bool) -> None:
        """The shards' θ_start into the model (``merge``: keeping the progress since the snapshot)."""
        with self._busy:
            for s in shards:
                self._states[s.key].load_into_param(merge)

    def start_from_local(self, shards: Iterable[LocalShard]) -> None:
        """θ_start is the model's own θ (the run's θ_0 is this rank's upload)."""
        for s in shards:
            self._states[s.key].start_from_local()


def _plans(shards: Iterable[LocalShard], updates: list) -> list[tuple[LocalShard, object, bool]]:
    """``(shard, payload, full)`` of each shard in each ``(header, payloads)``, in order."""
    shards, plans = list(shards), []
    for header, payloads in updates:
        by_key = {e.key: payload for e, (_, payload) in zip(header.entries, payloads, strict=True)}
        for s in shards:
            key = _entry_key(s)
            if key not in by_key:
                raise RuntimeError(f"update is missing tensor {s.name!r} region {s.offsets}+{s.sizes}")
            plans.append((s, by_key[key], header.kind is UpdateKind.FULL))
    return plans


def _check(plans: list[tuple[LocalShard, object, bool]]) -> None:
    """WireFormatError unless every payload fits its shard."""
    for s, payload, _ in plans:
        codec_of(payload).frame(payload, s.sizes)


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
