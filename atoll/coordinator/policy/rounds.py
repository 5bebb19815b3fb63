"""The round state machine as a pure function: ``decide(now, state, policy)``.

The servicer builds a :class:`RoundView` from its bookkeeping and acts on the returned
decision; tests build views by hand and move the clock instead of sleeping.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from atoll.coordinator.policy.grace import OFF, grace_until


class Decision(enum.Enum):
    WAIT = "wait"
    CLOSE = "close"


@dataclass(frozen=True, kw_only=True)
class RoundPolicy:
    quorum: int
    """Minimum committed islands for the round to close (an island behind a relay counts as one: a
    relay's push counts for its members)."""
    deadline_seconds: float
    """Seconds after the round opened when stragglers stop being waited for (the hard cap)."""
    grace: float | str = OFF
    """After quorum: wait for the missing live islands until their expected arrival ("auto"), a
    fixed number of seconds, or until the deadline ("off"). See :mod:`atoll.coordinator.policy.grace`."""
    decoupled: bool = False
    """Decoupled outer loop: an island training on an older θ is not waited for (its push will be
    folded, never committed to this round), and a grace window ends at ``DECOUPLED_SLACK`` of the
    shortest cycle of the committed islands after the quorum (at least ``DECOUPLED_FLOOR_SECONDS``;
    with no cycle known yet, of the quorum's time from the round's opening to its push)."""


DECOUPLED_SLACK = 0.5
"""Decoupled: the share of the quorum islands' cycle (the time between their pushes that count, on the
coordinator's clock) that a round waits past its quorum. They do not wait meanwhile, but a round kept
open makes their next pushes later (a longer round); the round closes well before they are due again
(Decoupled DiLoCo bounds its grace window by the slack that overlap leaves the quorum's learners). The
coordinator's own observations, never a figure an island reports: an island reporting a compute of
1e-6 s closed every round at its commit, and the others' on-time pushes were folded late."""
DECOUPLED_FLOOR_SECONDS = 0.25
"""The least a decoupled round's grace lasts past its quorum (when the grace is not off): rounds that
close sooner make the quorum's observed cycle shorter, which would shorten the grace again. About the
spread of equal islands' pushes on the map's machine (0.16-0.27 s). It was 1 s: at H=10, where the
fast islands push every ~0.22 s, every round then waited up to a second for a slow island that was
due within it, the fast islands' deltas grew to 6-12 H steps, and θ's loss at equal tokens was 2-6%
(speeds 1:2:4:8) and 7-19% (1:1:4) higher than with this floor (benchmarks/RESULTS.md)."""


@dataclass(frozen=True, kw_only=True)
class IslandView:
    island_id: str
    lease_expires_at: float
    committed: bool
    committed_at: float | None = None
    """When its push committed this round (None: not committed, or not known)."""
    expected: float | None = None
    """When in a round it is expected to commit, seconds after the round opened (None: no history)."""
    behind: bool = False
    """It holds an older θ than the open round's: its next push is for an older round."""
    cycle_seconds: float | None = None
    """The time between its pushes that count, smoothed, on the coordinator's clock (None: not known)."""
    counts: int | None = 1
    """The islands its push stands for: a relay's, the islands behind it (its push this round once
    committed, else its last one; None: a relay that has not pushed yet); 1 for an island."""


@dataclass(frozen=True, kw_only=True)
class RoundView:
    round: int
    opened_at: float
    islands: tuple[IslandView, ...]


NAMED = 8
"""Island ids a reason names before it counts the rest (3,000 joined islands made each line 60 KB)."""


def named(ids: list[str], most: int = NAMED) -> str:
    """``a, b, c`` or ``a, b, ... and 2,992 more``: a reason stays a line however many islands there are."""
    if len(ids) <= most:
        return ", ".join(ids)
    return f"{', '.join(ids[:most])} and {len(ids) - most:,} more"


def decide(now: float, state: RoundView, policy: RoundPolicy) -> tuple[Decision, str]:
    """Close the round when quorum has committed and either no live island is still missing, the
    grace window for the missing ones has passed, or the deadline has. Returns the decision and a
    reason worth logging."""
    committed = counted(i for i in state.islands if i.committed)
    missing = sorted(i.island_id for i in waited_for(now, state, policy))
    if committed < policy.quorum:
        return Decision.WAIT, (
            f"round {state.round}: {committed} of quorum {policy.quorum} committed"
            + (f", waiting for {named(missing)}" if missing else ", no other live island")
        )
    if not missing:
        return Decision.CLOSE, f"round {state.round}: all {committed} live islands committed"
    waited = now - state.opened_at
    if waited >= policy.deadline_seconds:
        return Decision.CLOSE, (
            f"round {state.round}: deadline {policy.deadline_seconds:g}s passed with quorum "
            f"({committed} committed); not waiting for {named(missing)}"
        )
    until, why = _grace(now, state, policy)
    if until is not None and now >= until:
        return Decision.CLOSE, f"round {state.round}: {why}; {named(missing)} did not come"
    left = f"{until - now:.1f}s of grace, " if until is not None else ""
    return Decision.WAIT, (
        f"round {state.round}: {committed} committed, waiting for {named(missing)} "
        f"({left}{policy.deadline_seconds - waited:.1f}s to deadline)"
    )


def counted(islands) -> int:
    """The islands these views stand for (a relay's: the islands behind it; one not known yet: 1)."""
    return sum(_counts(i) for i in islands)


def _counts(i: IslandView) -> int:
    return 1 if i.counts is None else i.counts


def waited_for(now: float, state: RoundView, policy: RoundPolicy) -> list[IslandView]:
    """The live islands the round still waits for: not committed, lease running, and (decoupled) not
    training on an older θ."""
    return [
        i for i in state.islands if not i.committed and i.lease_expires_at > now and not (policy.decoupled and i.behind)
    ]


def _grace(now: float, state: RoundView, policy: RoundPolicy) -> tuple[float | None, str]:
    """The end of the grace window of a round that has its quorum (None: none), and why."""
    quorum_at = _quorum_at(state, policy)
    if quorum_at is None:
        return None, ""
    missing = {i.island_id: i.expected for i in waited_for(now, state, policy)}
    until, why = grace_until(policy.grace, state.opened_at, quorum_at, missing)
    if policy.decoupled and policy.grace != OFF and missing:
        cycles = [i.cycle_seconds for i in state.islands if i.committed and i.cycle_seconds is not None]
        # No cycle known yet (a run's first round): the quorum's time from the round's opening to its
        # push stands for one. Round 0 had waited for the slowest island's first H steps (23 s of a 45-s
        # run at speeds 1:2:4:8, H=100), the fast islands' deltas growing meanwhile.
        cycle, of = (min(cycles), "cycle") if cycles else (quorum_at - state.opened_at, "time to its push")
        half = DECOUPLED_SLACK * cycle
        cap = quorum_at + max(half, DECOUPLED_FLOOR_SECONDS)
        if until is None or cap < until:
            return cap, (
                f"grace {cap - quorum_at:.3g}s after quorum (half the quorum's {of}: {half:.3g}s; "
                f"at least {DECOUPLED_FLOOR_SECONDS:g}s)"
            )
    return until, why


def _quorum_at(state: RoundView, policy: RoundPolicy) -> float | None:
    """When the committed pushes reached the quorum, in islands (None: they have not)."""
    times = sorted(
        (i.committed_at if i.committed_at is not None else state.opened_at, _counts(i))
        for i in state.islands
        if i.committed
    )
    reached = 0
    for at, counts in times:
        reached += counts
        if reached >= policy.quorum:
            return at
    return None


def next_wakeup(now: float, state: RoundView, policy: RoundPolicy, *, leases: bool = True) -> float | None:
    """When ``decide`` could next change its answer without new input: the deadline, the end of the
    grace window, or (``leases``) a lease expiring."""
    times = [state.opened_at + policy.deadline_seconds]
    if leases:
        times += [i.lease_expires_at for i in state.islands if not i.committed and i.lease_expires_at > now]
    until, _ = _grace(now, state, policy)
    if until is not None:
        times.append(until)
    future = [t for t in times if t > now]
    return min(future) if future else None


def stall(now: float, state: RoundView, policy: RoundPolicy) -> str | None:
    """Why the open round can never close as things stand (fewer islands committed or alive than the
    quorum), with what would unblock it; None while it can still close."""
    committed = sorted(i.island_id for i in state.islands if i.committed)
    live = sorted(i.island_id for i in state.islands if not i.committed and i.lease_expires_at > now)
    alive = [i for i in state.islands if i.committed or i.lease_expires_at > now]
    can = counted(alive)
    if can >= policy.quorum or any(i.counts is None for i in alive):
        return None  # (a live relay that has not pushed yet may stand for the islands still needed)
    gone = sorted(i.island_id for i in state.islands if not i.committed and i.lease_expires_at <= now)
    if not can and not gone:
        return None  # no member at all: the run waits for islands to join
    return (
        f"round {state.round} cannot reach quorum {policy.quorum}: {can} island(s) committed or alive"
        + (f" ({named(committed + live)})" if can else "")
        + (f"; gone: {named(gone)}" if gone else "")
        + ". Unblock: bring islands back"
        + (
            f", or lower the quorum to {can} (POST /api/config with the admin token, or restart with --quorum {can})"
            if can
            else ""
        )
    )
