"""The round state machine as a pure function: ``decide(now, state, policy)``.

The servicer builds a :class:`RoundView` from its bookkeeping and acts on the returned
decision; tests build views by hand and move the clock instead of sleeping.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class Decision(enum.Enum):
    WAIT = "wait"
    CLOSE = "close"


@dataclass(frozen=True, kw_only=True)
class RoundPolicy:
    quorum: int
    """Minimum committed islands for the round to close."""
    deadline_seconds: float
    """Seconds after the round opened when stragglers stop being waited for."""


@dataclass(frozen=True, kw_only=True)
class IslandView:
    island_id: str
    lease_expires_at: float
    committed: bool


@dataclass(frozen=True, kw_only=True)
class RoundView:
    round: int
    opened_at: float
    islands: tuple[IslandView, ...]


def decide(now: float, state: RoundView, policy: RoundPolicy) -> tuple[Decision, str]:
    """Close the round when quorum has committed and either no live island is still missing or
    the deadline has passed. Returns the decision and a reason worth logging."""
    committed = sorted(i.island_id for i in state.islands if i.committed)
    missing = sorted(i.island_id for i in state.islands if not i.committed and i.lease_expires_at > now)
    if len(committed) < policy.quorum:
        return Decision.WAIT, (
            f"round {state.round}: {len(committed)} of quorum {policy.quorum} committed"
            + (f", waiting for {', '.join(missing)}" if missing else ", no other live island")
        )
    if not missing:
        return Decision.CLOSE, f"round {state.round}: all {len(committed)} live islands committed"
    waited = now - state.opened_at
    if waited >= policy.deadline_seconds:
        return Decision.CLOSE, (
            f"round {state.round}: deadline {policy.deadline_seconds:g}s passed with quorum "
            f"({len(committed)} committed); not waiting for {', '.join(missing)}"
        )
    return Decision.WAIT, (
        f"round {state.round}: {len(committed)} committed, waiting for {', '.join(missing)} "
        f"({policy.deadline_seconds - waited:.1f}s to deadline)"
    )


def next_wakeup(now: float, state: RoundView, policy: RoundPolicy) -> float | None:
    """When ``decide`` could next change its answer without new input (deadline or lease expiry)."""
    times = [state.opened_at + policy.deadline_seconds]
    times += [i.lease_expires_at for i in state.islands if not i.committed and i.lease_expires_at > now]
    future = [t for t in times if t > now]
    return min(future) if future else None


def stall(now: float, state: RoundView, policy: RoundPolicy) -> str | None:
    """Why the open round can never close as things stand (fewer islands committed or alive than the
    quorum), with what would unblock it; None while it can still close."""
    committed = sorted(i.island_id for i in state.islands if i.committed)
    live = sorted(i.island_id for i in state.islands if not i.committed and i.lease_expires_at > now)
    if len(committed) + len(live) >= policy.quorum:
        return None
    gone = sorted(i.island_id for i in state.islands if not i.committed and i.lease_expires_at <= now)
    can = len(committed) + len(live)
    if not can and not gone:
        return None  # no member at all: the run waits for islands to join
    return (
        f"round {state.round} cannot reach quorum {policy.quorum}: {can} island(s) committed or alive"
        + (f" ({', '.join(committed + live)})" if can else "")
        + (f"; gone: {', '.join(gone)}" if gone else "")
        + ". Unblock: bring islands back"
        + (
            f", or lower the quorum to {can} (POST /api/config with the admin token, or restart with --quorum {can})"
            if can
            else ""
        )
    )
