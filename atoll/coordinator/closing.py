"""The decider: the background task that closes rounds.

It evaluates :func:`~atoll.coordinator.rounds.decide` on every change and at deadlines, and asks the
run to close a round (:meth:`RunState.close_round`) or to retry the save of a sealed one
(:meth:`RunState.try_publish`: a failed save is retried with capped backoff, so rounds resume by
themselves once there is space). It logs what the round waits for and when it cannot close at all.
Any exception escapes :func:`run_decider`, so the server exits non-zero (never a silently dead task).
"""

from __future__ import annotations

import asyncio
import logging

from atoll.coordinator.core import RunState
from atoll.coordinator.pulls import wait_event
from atoll.coordinator.rounds import Decision, IslandView, RoundView, decide, next_wakeup, stall

log = logging.getLogger("atoll.coordinator")


def view(s: RunState) -> RoundView:
    committed = s.accumulator.committed
    islands = tuple(
        IslandView(island_id=i.island_id, lease_expires_at=i.lease_expires_at, committed=i.island_id in committed)
        for i in s.membership.islands.values()
    )
    extra = tuple(  # committed islands that left since still count
        IslandView(island_id=k, lease_expires_at=0.0, committed=True)
        for k in committed
        if k not in s.membership.islands
    )
    return RoundView(round=s.round, opened_at=s.ledger.opened_at, islands=islands + extra)


async def run_decider(s: RunState) -> None:
    """Background task: close rounds when ``decide`` says so, retry a pending save, log what the round
    waits for and when it cannot close at all."""
    last_reason = ""
    while True:
        timeout = 1.0
        for rec in s.membership.newly_expired():
            log.warning(
                "%sisland %s: lease expired (%.0fs without a call); not waited for until it is back",
                s.name,
                rec.island_id,
                s.config.lease_seconds,
            )
        sealed = s.ledger.sealed
        if sealed is not None:
            if not await s.try_publish():
                await asyncio.sleep(sealed.retry_in)
                continue
        elif s.model.ready and not s.run_complete:
            now = s.clock()
            v = view(s)
            decision, reason = decide(now, v, s.policy())
            if decision is Decision.CLOSE:
                await s.close_round(reason)
                continue
            s.waiting = reason
            if reason != last_reason:
                log.info("%s%s", s.name, reason)
                last_reason = reason
            stuck = stall(now, v, s.policy())
            if stuck != s.stall:
                if stuck:
                    log.warning("%s%s", s.name, stuck)
                elif s.stall:
                    log.info("%sround %d can reach quorum again", s.name, s.round)
                s.stall = stuck
            wake = next_wakeup(now, v, s.policy())
            if wake is not None:
                timeout = min(max(wake - now, 0.005), 1.0)
        await wait_event(s.ledger.poke, timeout)
        s.ledger.poke.clear()
