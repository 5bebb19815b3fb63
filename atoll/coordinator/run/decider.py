"""The decider: the background task that closes rounds.

It evaluates :func:`~atoll.coordinator.policy.rounds.decide` on every change and at deadlines, and asks the
run to close a round (:meth:`RunState.close_round`) or to retry the save of a sealed one
(:meth:`RunState.try_publish`: a failed save is retried with capped backoff, so rounds resume by
themselves once there is space). It logs what the round waits for and when it cannot close at all.
Any exception escapes :func:`run_decider`, so the server exits non-zero (never a silently dead task).
"""

from __future__ import annotations

import asyncio
import logging

from atoll.coordinator.policy.rounds import NAMED, Decision, IslandView, RoundView, decide, next_wakeup, stall
from atoll.coordinator.run.pulls import wait_event
from atoll.coordinator.run.run_state import RunState

log = logging.getLogger("atoll.coordinator")

REMIND_SECONDS = 30.0
"""While a round waits and nothing changes, its state is logged again at most this often."""


class Reminder:
    """When a waiting round is worth a log line: when what it waits for changes (its round, who
    committed, who it waits for), and otherwise every ``every`` seconds; /api/status has the live detail."""

    def __init__(self, every: float = REMIND_SECONDS) -> None:
        self.every = every
        self._key: object = None
        self._at = float("-inf")

    def due(self, now: float, key: object) -> bool:
        if key != self._key or now - self._at >= self.every:
            self._key, self._at = key, now
            return True
        return False


class StallReport:
    """When a stall is worth a WARNING: once it has lasted ``grace`` seconds (a lease: islands still
    joining at the start of a run, or leaving at its end, are not a stall an operator must act on).
    /api/status shows it at once."""

    def __init__(self) -> None:
        self.since: float | None = None
        self.warned = False

    def update(self, now: float, stuck: str | None, grace: float) -> tuple[int, str] | None:
        """(log level, line) to log now, if any: the stall at WARNING once it lasted ``grace``, and its
        end at INFO when it had been warned about."""
        if stuck is None:
            warned, self.since, self.warned = self.warned, None, False
            return (logging.INFO, "the round can reach quorum again") if warned else None
        if self.since is None:
            self.since = now
        if not self.warned and now - self.since >= grace:
            self.warned = True
            return logging.WARNING, stuck
        return None


def waiting_key(v: RoundView, now: float) -> tuple:
    """What a waiting round's log line is about: the round, who committed, who is live and missing while
    the line names them all (past :data:`NAMED` it counts them: an island that joins or goes among
    thousands is its own line, not a new line of the waiting list each time)."""
    committed = tuple(sorted(i.island_id for i in v.islands if i.committed))
    missing = tuple(sorted(i.island_id for i in v.islands if not i.committed and i.lease_expires_at > now))
    return v.round, committed, missing if len(missing) <= NAMED else "many"


def view(s: RunState) -> RoundView:
    committed = s.accumulator.committed

    def island(i) -> IslandView:
        c = committed.get(i.island_id)
        return IslandView(
            island_id=i.island_id,
            lease_expires_at=i.lease_expires_at,
            committed=c is not None,
            committed_at=None if c is None else c.at,
            expected=i.arrival.expected(),
            behind=0 <= i.holds_round < s.round,
            cycle_seconds=i.cycle.mean,
            counts=len(c.members) if c is not None and c.members else i.stands_for,
        )

    islands = tuple(island(i) for i in s.membership.islands.values())
    extra = tuple(  # committed islands that left since still count
        IslandView(island_id=k, lease_expires_at=0.0, committed=True, counts=len(c.members) or 1)
        for k, c in committed.items()
        if k not in s.membership.islands
    )
    return RoundView(round=s.round, opened_at=s.ledger.opened_at, islands=islands + extra)


async def run_decider(s: RunState) -> None:
    """Background task: close rounds when ``decide`` says so, retry a pending save, log what the round
    waits for and when it cannot close at all."""
    reminder, stalls = Reminder(), StallReport()
    while True:
        timeout = 1.0
        for island_id in s.membership.forget_silent():
            s.accumulator.drop_island(island_id)  # (a rank of it may have staged a push)
            log.info("%sisland %s: gone long, and never committed a push; forgotten (it may join again)",
                     s.name, island_id)  # fmt: skip
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
            if reminder.due(now, waiting_key(v, now)):
                log.info("%s%s", s.name, reason)
            stuck = stall(now, v, s.policy())
            said = stalls.update(now, stuck, s.config.lease_seconds)
            if said is not None:
                log.log(said[0], "%s%s", s.name, said[1])
            s.stall = stuck
            if stuck is not None:
                timeout = min(timeout, max(stalls.since + s.config.lease_seconds - now, 0.005))
            wake = next_wakeup(now, v, s.policy())
            if wake is not None:
                timeout = min(max(wake - now, 0.005), 1.0)
        await wait_event(s.ledger.poke, timeout)
        s.ledger.poke.clear()
