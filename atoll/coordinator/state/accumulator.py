"""The open round's accumulator: staged pushes, committed and folded contributions, the running sum of
weighted pseudo-gradients, the in-flight byte budget and the open push streams.

:class:`RoundAccumulator` is their one owner. A push's ranks are *staged* until the island's last rank
arrives; the island's contribution then *commits* whole (or is *folded*, late, with a staleness
weight) and is decoded into the sum. At the close the core *takes* the sum for the outer step and
the accumulator *advances* to the next round.
"""

from __future__ import annotations

import functools
import logging

import torch

from atoll.compression.base import weighted
from atoll.coordinator.errors import Reason, refuse
from atoll.coordinator.policy import order
from atoll.coordinator.policy.goodput import tokens_per_step
from atoll.coordinator.policy.steps import DecoupledStep
from atoll.coordinator.policy.weighting import PushClass, step_scale
from atoll.coordinator.state import robust
from atoll.coordinator.state.budget import InflightBudget, Reservation
from atoll.coordinator.state.downlink import identity_size
from atoll.coordinator.state.plans import Committed, HeldPush, StagedRank, release
from atoll.coordinator.state.workers import SERIAL, TensorWorkers
from atoll.protos.rpc import BufferPool

log = logging.getLogger("atoll.coordinator")

MIN_INFLIGHT_BYTES = 256 << 20
SUM_LIMIT = 2.0**100
"""The most Σ weight_i x (the largest value of Δ_i) a round's sum may reach: fp32 holds 2^128, so no
add can overflow it, whatever the order (each |Δ_i| is also bounded: checks.MAX_TENSOR_NORM)."""
REGION_SLACK = 64
"""Framing bytes allowed per tensor beyond one identity payload's (a rank's region has its own)."""


def fp32_push_bytes(specs: dict[str, tuple[int, ...]]) -> int:
    """Bytes of one identity (fp32) push of the whole model, payload framing included."""
    return sum(identity_size(s) + REGION_SLACK for s in specs.values())


def mean_of(pairs: list[tuple[float, float]]) -> float | None:
    """The weighted mean of (weight, value) pairs, the weights normalised first: no product can overflow
    (a value is bounded, ``checks.MAX_REPORTED_LOSS``, and so is the mean). None when there are none."""
    total = sum(w for w, _ in pairs)
    return sum(w / total * v for w, v in pairs) if pairs else None


class RoundAccumulator:
    def __init__(self, max_inflight_bytes: int = 0, workers: TensorWorkers = SERIAL) -> None:
        """``max_inflight_bytes``: push bytes held at once (0: sized from the model, see :meth:`size_budget`);
        ``workers``: the threads a contribution is decoded on, several tensors at once."""
        self.workers = workers
        self.budget = InflightBudget(max_inflight_bytes or MIN_INFLIGHT_BYTES)
        self._budget_from_model = not max_inflight_bytes
        self.pending: dict[tuple[str, int], dict[int, StagedRank]] = {}
        """Ranks staged so far, by (island, round the push is for)."""
        self.committed: dict[str, Committed] = {}
        """Islands whose contribution to the open round is complete."""
        self.late: dict[tuple[str, int], Committed] = {}
        """Late contributions (island, their round) folded into the open round."""
        self.folded: set[tuple[str, int]] = set()
        """Every (island, round) folded in recent rounds: a late delta is applied once."""
        self.dense: dict[tuple[str, int], tuple[float, dict[str, torch.Tensor]]] = {}
        """Robust aggregation: each contribution's (weight, dense delta) for the open round."""
        self.streams: set[tuple[str, int]] = set()
        """(island, rank) of the push streams open now."""
        self.too_stale: set[tuple[str, int]] = set()
        """(island, round) of the deltas that came too late to fold while this round was open (dropped)."""
        self.relayed: dict[str, str] = {}
        """Islands whose work for the open round came in a relay's push, each with that relay: a push of
        their own for it (their relay died, and they moved here) counts already."""
        self.held: dict[str, HeldPush] = {}
        """Committed contributions not in the sum yet, each waiting (still encoded, its bytes still held
        against the budget) for one that sorts ahead of it (:mod:`~atoll.coordinator.policy.order`)."""
        self.sequence: list[str] = []
        """The islands whose contributions entered the open round's sum, in the order they did."""
        self._arrival = False
        """The open round's sum took a contribution outside the fixed order (a late delta folded in)."""
        self._sums: dict[str, torch.Tensor] = {}
        self._bound = 0.0
        """Σ weight x magnitude of the contributions admitted into the sum: no element can exceed it."""
        self._stale: set[str] = set()
        """Tensors of the sum that hold old values and count as zero (see :meth:`reset`)."""
        self.buffers = BufferPool(lambda: self.budget.limit)
        """Push entry buffers reused round after round (no page faults), no more than the budget."""

    # ---- the budget and the streams ------------------------------------------------------------
    def size_budget(self, specs: dict[str, tuple[int, ...]], name: str = "") -> None:
        """The default in-flight budget: two whole fp32 pushes of the model with their framing (at least
        256 MiB), so two islands' identity pushes are admitted at once; sized from a joining island's
        declared model before θ_0 exists, so θ_0's own upload fits. An explicit budget below one fp32
        push is logged (prefixed by ``name``): such pushes are always refused."""
        push_bytes = fp32_push_bytes(specs)
        if self._budget_from_model:
            self.budget.limit = max(self.budget.limit, MIN_INFLIGHT_BYTES, 2 * push_bytes)
            return
        if push_bytes <= self.budget.limit:
            return
        log.error(
            "%s--max-inflight-bytes %d is below one fp32 push of this model (%d bytes): such pushes are always "
            "refused; raise it (compressed pushes are smaller)",
            name,
            self.budget.limit,
            push_bytes,
        )

    def open_stream(self, island_id: str, rank: int, num_bytes: int) -> Reservation:
        """Admit a push stream for the ``num_bytes`` its header declares, or refuse it now, before its
        data flows (INFLIGHT_BUDGET: the island retries with backoff; PUSH_IN_PROGRESS: one open stream
        per (island, rank)). Memory still follows the bytes that arrive; the budget holds the declared
        size until the stream's payloads are consumed or dropped."""
        if (island_id, rank) in self.streams:
            raise refuse(Reason.PUSH_IN_PROGRESS, f"a push stream of island {island_id!r} rank {rank} is already open")
        reservation = Reservation(self.budget)
        reservation.add(num_bytes)
        self.streams.add((island_id, rank))
        return reservation

    def close_stream(self, island_id: str, rank: int) -> None:
        self.streams.discard((island_id, rank))

    # ---- staging and committing ----------------------------------------------------------------
    def is_done(self, island_id: str, round_: int, cls: PushClass) -> bool:
        return (island_id, round_) in self.folded if cls is PushClass.LATE else island_id in self.committed

    def is_duplicate(self, island_id: str, round_: int, rank: int, cls: PushClass) -> bool:
        return self.is_done(island_id, round_, cls) or rank in self.pending.get((island_id, round_), {})

    def stage(self, staged: StagedRank, num_ranks: int) -> list[StagedRank] | None:
        """Add one rank; returns the island's ranks in order once all are in (and unstages them)."""
        key = (staged.plan.island_id, staged.plan.round)
        ranks = self.pending.setdefault(key, {})
        ranks[staged.plan.rank] = staged
        if len(ranks) < num_ranks:
            return None
        del self.pending[key]
        return [ranks[r] for r in sorted(ranks)]

    def admit(self, bound: float, what: str) -> None:
        """Room in the round's sum for a contribution whose weighted values are at most ``bound`` in
        magnitude, or DELTA_TOO_LARGE (nothing is added): the sum's elements stay below
        :data:`SUM_LIMIT`, so the sum and the mean the outer step takes of it stay finite."""
        if not self._bound + bound <= SUM_LIMIT:
            raise refuse(
                Reason.DELTA_TOO_LARGE,
                f"{what}: its values times its weight (up to {bound:.3g}) would take the round's sum past "
                f"{SUM_LIMIT:.3g} (refused before it was added)",
            )
        self._bound += bound

    def add(self, ranks: list[StagedRank], codec, weight: float, island: str | None = None) -> None:
        """``sum += weight · Δ`` for an island's ranks, decoded straight into the sum (worker thread).
        ``island``: whose contribution it is, in the fixed order; None: a late delta, out of it."""
        accumulate(ranks, self._sums, codec, weight, self._stale, self.workers)
        if island is None:
            self._arrival = True
        else:
            self.sequence.append(island)

    # ---- the fixed order of the sum ------------------------------------------------------------
    def hold(self, island_id: str, held: HeldPush) -> None:
        """Keep a committed contribution out of the sum until :meth:`ready` lets it in."""
        self.held[island_id] = held

    def held_bytes(self) -> int:
        """The in-flight budget's bytes the held contributions keep."""
        return sum(reserved(h.ranks) for h in self.held.values())

    def ready(self, waiting) -> list[str]:
        """The held contributions that may enter the sum now, in their order (``waiting``: the islands
        whose push for the round may still come)."""
        return order.ready(self.held, len(self.sequence), waiting)

    def sum_order(self) -> str | None:
        """The open round's sum's order so far (:data:`~atoll.coordinator.policy.order.FIXED` or
        ``ARRIVAL``; None: nothing entered it)."""
        if self._arrival:
            return order.ARRIVAL
        return order.order_of(self.sequence) if self.sequence else None

    def recycle(self, ranks: list[StagedRank]) -> None:
        """The ranks' payloads are in the sum and read no more: their buffers serve the next pushes."""
        for staged in ranks:
            for payload in staged.payloads:
                self.buffers.give(payload)
            staged.payloads = []

    def add_dense(self, key: tuple[str, int], delta: dict[str, torch.Tensor], weight: float, mean: bool) -> None:
        """A contribution already decoded densely: added (``mean``) or kept for robust aggregation."""
        if mean:
            for name, t in delta.items():
                self._zeroed(name).add_(t, alpha=weight)
            self._arrival = True  # (a fused multiply-add, in arrival order)
        else:
            self.dense[key] = (weight, delta)

    def commit(self, island_id: str, round_: int, record: Committed, late: bool) -> None:
        if late:
            self.late[(island_id, round_)] = record
            self.folded.add((island_id, round_))
        else:
            self.committed[island_id] = record
            self.relayed.update((m.island_id, island_id) for m in record.members)

    def committed_islands(self) -> list[str]:
        return sorted(self.committed)

    def tokens_per_step(self) -> float | None:
        """Tokens per inner step of this round's committed islands that report both (None: none do)."""
        return tokens_per_step((c.tokens, c.inner_steps) for c in self.committed.values())

    def weight_total(self) -> float:
        return sum(c.weight for c in self.committed.values()) + sum(c.weight for c in self.late.values())

    def entered_weight(self, rule: DecoupledStep, sync_every: int) -> float:
        """Σ w_i s_i over the round's contributions, s_i the step scale of a decoupled run's delta under
        ``rule`` (:func:`~atoll.coordinator.policy.weighting.step_scale`)."""
        return sum(
            c.entered if c.entered is not None else c.weight * step_scale(rule, sync_every, c.inner_steps)
            for c in (*self.committed.values(), *self.late.values())
        )

    def drop_island(self, island_id: str) -> None:
        """Forget an island's staged (incomplete) pushes."""
        for key in [k for k in self.pending if k[0] == island_id]:
            release(self.pending.pop(key).values())

    def staged_bytes(self) -> int:
        return sum(r.plan.num_bytes for ranks in self.pending.values() for r in ranks.values())

    # ---- the close -------------------------------------------------------------------------------
    def sum_tensors(self) -> list[torch.Tensor]:
        """The open round's sum's tensors (for an account of the memory held)."""
        return list(self._sums.values())

    def reset(self, sums: dict[str, torch.Tensor], stale: set[str] | None = None) -> None:
        """A fresh sum for the open round (``sums``: shaped like θ). The tensors named in ``stale`` hold
        old values (the θ a publish replaced) and count as zero: the first contribution to one is
        written into it rather than added (:func:`~atoll.coordinator.state.plans.accumulate`), which
        saves zeroing |θ| after every publish, and :meth:`take` zeroes those that got none."""
        self._sums, self._stale, self._bound = sums, set(stale or ()), 0.0

    def _zeroed(self, name: str) -> torch.Tensor:
        """The sum's tensor ``name``, zeroed first if it still held old values."""
        if name in self._stale:
            self._stale.discard(name)
            self._sums[name].zero_()
        return self._sums[name]

    def take(self, aggregation: str, clip_norm: float) -> tuple[dict[str, torch.Tensor], dict | None]:
        """The round's sum for the outer step (it is θ_{r+1}'s storage from then on) and, for a robust
        ``aggregation``, the aggregated pseudo-gradient (None for the mean)."""
        robust_grads = None
        if aggregation != "mean":
            robust_grads = robust.aggregate(aggregation, list(self.dense.values()), clip_norm=clip_norm)
        for name in list(self._stale):  # no contribution this round: zero, not old values
            self._zeroed(name)
        sums, self._sums = self._sums, {}
        return sums, robust_grads

    def record(self) -> dict:
        """The open round's contributions for its history record: who committed, who was folded late
        (``late``: [island, round]) or came too late to fold (``too_stale``), and per island the tokens,
        inner steps, compute seconds and bytes of everything that entered θ (folded ones included), and
        the seconds their decoding into the sum took, all together."""
        entered = [*self.committed.items(), *((i, x) for (i, _), x in self.late.items())]
        reports = [m for x in self.committed.values() for m in (x.members or (x,))]  # a relay's: its islands'
        losses = [(max(x.tokens, 1), x.loss) for x in reports if x.loss is not None]

        def by_island(field: str) -> dict:
            """Per island; the islands behind a relay as ``relay/island`` (its bytes are the relay's)."""
            out: dict = {}
            for island, x in entered:
                if x.members and field != "num_bytes":
                    for m in x.members:
                        key = m.named(island)
                        out[key] = out.get(key, 0) + getattr(m, field)
                else:
                    out[island] = out.get(island, 0) + getattr(x, field)
            return dict(sorted(out.items()))

        return {
            "islands": sorted(self.committed),
            "late": sorted([island, rnd] for island, rnd in self.late),
            "too_stale": sorted([island, rnd] for island, rnd in self.too_stale),
            "tokens": sum(x.tokens for _, x in entered),
            "tokens_by_island": by_island("tokens"),
            "steps_by_island": by_island("inner_steps"),
            "compute_seconds_by_island": by_island("compute_seconds"),
            "bytes_by_island": by_island("num_bytes"),
            "loss": mean_of(losses),
            "bytes_in": sum(x.num_bytes for _, x in entered),
            "decode_seconds": sum(x.decode_seconds for _, x in entered),
            "relayed": dict(sorted(self.relayed.items())) or None,
            "sum_order": self.sum_order(),
        }

    def advance(self, keep_from: int) -> None:
        """The round closed: clear its contributions; keep staged pushes for rounds >= ``keep_from``."""
        self.committed, self.late, self.dense, self.too_stale, self.relayed = {}, {}, {}, set(), {}
        if self.held:  # (the close adds them first: none is left unless the step failed)
            release(r for h in self.held.values() for r in h.ranks)
        self.held, self.sequence, self._arrival = {}, [], False
        for key in [k for k in self.pending if k[1] < keep_from]:
            release(self.pending.pop(key).values())
        self.folded = {k for k in self.folded if k[1] >= keep_from - 1}

    def sum_of(self, name: str) -> torch.Tensor:
        """The open round's running sum of one tensor (for inspection)."""
        return self._zeroed(name)


def reserved(ranks: list[StagedRank]) -> int:
    """The in-flight budget's bytes ``ranks`` keep."""
    return sum(r.reservation.bytes for r in ranks if r.reservation is not None)


def assemble(ranks: list[StagedRank], specs: dict[str, tuple[int, ...]], codec) -> dict[str, torch.Tensor]:
    """An island's whole delta, decoded densely (for the norm bound and robust aggregation)."""
    out = {k: torch.zeros(s, dtype=torch.float32) for k, s in specs.items()}
    for staged in ranks:
        for entry, payload in zip(staged.plan.entries, staged.payloads, strict=True):
            out[entry.name][entry.region.slices()] = codec.decode(payload, entry.region.sizes, verified=True)
    return out


def accumulate(
    ranks: list[StagedRank],
    accum: dict[str, torch.Tensor],
    codec,
    weight: float,
    stale: set[str] | None = None,
    workers: TensorWorkers = SERIAL,
) -> None:
    """``accum += weight * Δ`` for an island's ranks, decoding straight into the accumulator. ``weight * Δ``
    is rounded before the add, so two islands sum to the same bits in either order (the sum's first two
    commute: :mod:`~atoll.coordinator.policy.order` fixes the rest). A tensor
    named in ``stale`` holds old values that count as zero: an entry covering all of it is written
    (``weight * Δ``, the bits ``0 + weight * Δ`` gives), else the tensor is zeroed first; its name
    leaves ``stale`` either way. ``workers``: the tensors are decoded on them, several at once; the
    entries of one tensor (the ranks' regions of it) in one task, in their order, so every element
    gets the same operations in the same order whatever their number."""
    by_tensor: dict[str, list] = {}
    for staged in ranks:
        for entry, payload in zip(staged.plan.entries, staged.payloads, strict=True):
            by_tensor.setdefault(entry.name, []).append((entry, payload))

    def one(whole: torch.Tensor, entries: list, was_stale: bool) -> None:
        for i, (entry, payload) in enumerate(entries):
            target = whole[entry.region.slices()]
            if i == 0 and was_stale:
                if target.numel() == whole.numel() and target.is_contiguous():
                    codec.write_weighted_(payload, target, alpha=weight, verified=True)
                    continue
                whole.zero_()
            if target.is_contiguous():  # every entry was checked as it arrived (its crc32c too)
                codec.decode_add_(payload, target, alpha=weight, verified=True)
            else:
                got = codec.decode(payload, entry.region.sizes, verified=True)
                target.add_(weighted(got, weight))  # no fused w·Δ + acc

    tasks = []
    for name, entries in by_tensor.items():
        was_stale = stale is not None and name in stale
        if was_stale:
            stale.discard(name)
        tasks.append((name, functools.partial(one, accum[name], entries, was_stale)))
    workers.ordered(tasks)
