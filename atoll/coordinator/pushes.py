"""Pushes: a header planned against the open round, its bytes held against the in-flight budget while
they stream, each entry validated as it completes, the island's contribution committed whole once
its last rank is in (and decoded into the accumulator), θ_0 from the bootstrap island.

Functions of the :class:`~atoll.coordinator.core.RunState` they act on; the core sequences them.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

import torch

from atoll.compression import WireFormatError, get_codec
from atoll.coordinator import checks, persistence, robust
from atoll.coordinator.errors import Reason, invalid, refuse
from atoll.coordinator.messages import PushHeader, PushKind, PushOutcome, PushResult
from atoll.coordinator.staging import (
    Committed,
    PushClass,
    PushPlan,
    Reservation,
    StagedRank,
    accumulate,
    assemble,
    classify,
    release,
)

if TYPE_CHECKING:
    from atoll.coordinator.core import RunState

log = logging.getLogger("atoll.coordinator")

INIT_ROUND = -1
"""The "round" under which a bootstrap island's INIT shards are staged."""


def plan(s: RunState, h: PushHeader) -> PushPlan | PushResult:
    """Validate a push header. Returns the plan, or the result when nothing is to be read."""
    checks.run_id(s.config, h.run_id)
    rec = s.membership.touch(h.island_id, h.session_id)
    cls = PushClass.NEW
    if h.kind is PushKind.INIT:
        if s.params is not None:
            return PushResult(PushOutcome.DUPLICATE, s.round, committed=True)
        if not s.membership.claim_bootstrap(h.island_id):
            raise refuse(
                Reason.NOT_BOOTSTRAPPER,
                f"island {h.island_id!r} is not the bootstrap island ({s.membership.bootstrapper!r})",
            )
        if h.codec != "identity":
            raise invalid("INIT pushes must use the identity codec")
        specs = checks.tensors(rec.tensors)
    elif h.kind is PushKind.DELTA:
        if s.params is None:
            raise refuse(Reason.NO_PARAMETERS, "the run has no parameters yet (bootstrap pending)")
        if s.run_complete:
            return PushResult(PushOutcome.RUN_COMPLETE, s.round, committed=False)
        checks.codec(s.config, h.codec)
        cls = classify_push(s, h.round)
        if cls is PushClass.FUTURE:
            raise refuse(
                Reason.ROUND_IN_FUTURE,
                f"round {h.round} is in the future; the coordinator is at round {s.round}",
            )
        if cls is PushClass.CLOSED:
            if 0 <= h.round < len(s.history) and h.island_id in s.history[h.round]["islands"]:
                return PushResult(PushOutcome.DUPLICATE, s.round, committed=True)  # counted before it closed
            return PushResult(PushOutcome.ROUND_CLOSED, s.round, committed=False)
        if s.staging.is_duplicate(h.island_id, h.round, h.rank, cls):
            done = s.staging.is_done(h.island_id, h.round, cls)
            return PushResult(PushOutcome.DUPLICATE, s.round, committed=done)
        checks.tokens(s.config, h.tokens)
        specs = s.specs
        s.release_pulled_update()  # the update was written meanwhile: the pushes may have its room
    else:
        raise invalid("unknown push kind")
    entries = checks.push_header(h, rec.num_ranks, specs)
    return PushPlan(
        h.island_id,
        INIT_ROUND if h.kind is PushKind.INIT else h.round,
        h.kind is PushKind.INIT,
        h.rank,
        h.num_ranks,
        h.tokens,
        h.loss,
        h.codec,
        entries,
        late=cls is PushClass.LATE,
    )


def classify_push(s: RunState, push_round: int) -> PushClass:
    c = s.config
    return classify(
        push_round,
        s.round,
        sealed=s.sealed is not None,
        fold=c.late_policy == "fold",
        max_staleness=c.max_staleness,
    )


def open_stream(s: RunState, island_id: str, rank: int) -> Reservation:
    """One open push stream per (island, rank); its bytes are held against the in-flight budget."""
    if (island_id, rank) in s.streams:
        raise refuse(Reason.PUSH_IN_PROGRESS, f"a push stream of island {island_id!r} rank {rank} is already open")
    s.streams.add((island_id, rank))
    return Reservation(s.budget)


def close_stream(s: RunState, island_id: str, rank: int) -> None:
    s.streams.discard((island_id, rank))


def check_entry(s: RunState, plan: PushPlan, index: int, payload) -> None:
    """Validate one entry's payload (structure, bounds, finite values) without decoding it densely.

    Runs in a worker thread; the payload stays encoded until the island's contribution commits."""
    entry = plan.entries[index]
    codec = get_codec("identity") if plan.init else s.uplink
    try:
        codec.validate(payload, entry.region.sizes)
    except WireFormatError as err:
        raise refuse(Reason.BAD_PAYLOAD, f"tensor {entry.name!r}: {err}") from None


async def commit(s: RunState, plan: PushPlan, payloads: list, reservation: Reservation) -> PushResult:
    """Stage one rank's validated payloads; the island's contribution commits when all its ranks are
    in. The reservation is released once the payloads are consumed or dropped."""
    async with s.lock:
        staged = StagedRank(plan, payloads, reservation)
        try:
            if plan.init:
                return await _commit_init(s, staged)
            return await _commit_delta(s, staged)
        except BaseException:
            release([staged])
            raise


async def _commit_delta(s: RunState, staged: StagedRank) -> PushResult:
    plan = staged.plan
    cls = classify_push(s, plan.round)  # the round may have moved while the push streamed
    if cls in (PushClass.CLOSED, PushClass.FUTURE):
        release([staged])
        return PushResult(PushOutcome.ROUND_CLOSED, s.round, committed=False)
    rec = s.membership.islands.get(plan.island_id)
    if rec is None or rec.num_ranks != plan.num_ranks:
        raise refuse(Reason.NOT_JOINED, f"island {plan.island_id!r} left or re-joined while pushing")
    if s.staging.is_duplicate(plan.island_id, plan.round, plan.rank, cls):
        release([staged])
        done = s.staging.is_done(plan.island_id, plan.round, cls)
        return PushResult(PushOutcome.DUPLICATE, s.round, committed=done)
    ranks = s.staging.stage(staged, rec.num_ranks)
    if ranks is None:
        return PushResult(PushOutcome.STAGED, s.round, committed=False, bytes_received=plan.num_bytes)
    try:
        checks.coverage(s.specs, ranks, f"island {plan.island_id!r} discarded for round {s.round}")
        weight = float(max(plan.tokens, 1))
        if cls is PushClass.LATE:
            weight *= s.config.staleness_weight ** (s.round - plan.round)
        if s.config.aggregation == "mean" and not s.config.max_delta_norm:
            await asyncio.to_thread(accumulate, ranks, s.accum, s.uplink, weight)
        else:
            await _stage_dense(s, (plan.island_id, plan.round), ranks, weight)
    finally:
        release(ranks)  # decoded into the accumulator (or refused): the payloads are done
    num_bytes = sum(r.plan.num_bytes for r in ranks)
    record = Committed(ranks[0].plan.tokens, ranks[0].plan.loss, num_bytes, weight)
    late = cls is PushClass.LATE
    s.staging.commit(plan.island_id, plan.round, record, late)
    rec.last_push_at = s.clock()
    if late:
        log.info(
            "%sround %d: folded island %s's late delta for round %d (weight %.3g)",
            s.name,
            s.round,
            plan.island_id,
            plan.round,
            weight,
        )
    else:
        rec.rounds_committed += 1
        rec.last_committed_round = plan.round
        log.info("%sround %d: island %s committed (%d tokens)", s.name, s.round, plan.island_id, plan.tokens)
    s.poke.set()
    outcome = PushOutcome.FOLDED if late else PushOutcome.COMMITTED
    return PushResult(outcome, s.round, committed=True, bytes_received=plan.num_bytes)


async def _stage_dense(s: RunState, key: tuple[str, int], ranks: list[StagedRank], weight: float) -> None:
    """Norm bound and robust aggregation need the island's whole delta: assemble it densely."""
    delta = await asyncio.to_thread(assemble, ranks, s.specs, s.uplink)
    norm = robust.l2_norm(delta)
    bound = s.config.max_delta_norm
    if bound and norm > bound:
        raise refuse(
            Reason.DELTA_TOO_LARGE,
            f"island {key[0]!r} discarded for round {key[1]}: delta norm {norm:.4g} exceeds {bound:g}",
        )
    if s.config.aggregation == "mean":
        for name, t in delta.items():
            s.accum[name].add_(t, alpha=weight)
    else:
        s.staging.dense[key] = (weight, delta)


async def _commit_init(s: RunState, staged: StagedRank) -> PushResult:
    plan = staged.plan
    if s.params is not None:
        release([staged])
        return PushResult(PushOutcome.DUPLICATE, s.round, committed=True)
    rec = s.membership.islands.get(plan.island_id)
    if rec is None or not s.membership.claim_bootstrap(plan.island_id):
        raise refuse(Reason.NOT_BOOTSTRAPPER, f"island {plan.island_id!r} no longer holds the bootstrap claim")
    ranks = s.staging.stage(staged, plan.num_ranks)
    if ranks is None:
        return PushResult(PushOutcome.STAGED, 0, committed=False, bytes_received=plan.num_bytes)
    try:
        specs = checks.tensors(rec.tensors)
        checks.coverage(specs, ranks, "bootstrap θ rejected")
        params = {k: torch.zeros(s, dtype=torch.float32) for k, s in specs.items()}
        ident = get_codec("identity")
        for r in ranks:
            for entry, payload in zip(r.plan.entries, r.payloads, strict=True):
                params[entry.name][entry.region.slices()] = ident.decode(payload, entry.region.sizes)
    finally:
        release(ranks)
    s.specs, s.buffers = specs, checks.buffers_of(rec.tensors)
    s.layout_digest = rec.layout_digest or None
    s._init_optimizer()
    try:
        await asyncio.to_thread(persistence.save, s.state_dir, s.snapshot(params, 0, []), keep=s.keep_snapshots)
    except Exception as err:  # the island retries its bootstrap push (UNAVAILABLE)
        s.specs, s.buffers = {}, frozenset()
        s.problem = f"saving θ_0 failed: {err}"
        log.error("%s%s", s.name, s.problem)
        raise refuse(Reason.NO_PARAMETERS, f"the coordinator could not save θ_0 ({err}); retry") from None
    s.problem = None
    s.params = params
    s.round = 0
    s.opened_at = s.clock()
    s._reset_accum()
    s._size_budget()
    log.info("%sbootstrapped θ_0 from island %s (%d tensors)", s.name, plan.island_id, len(params))
    s.publish()
    return PushResult(PushOutcome.COMMITTED, 0, committed=True, bytes_received=plan.num_bytes)
