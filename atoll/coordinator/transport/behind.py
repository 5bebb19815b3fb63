"""The islands behind a relay, as the root's admin port shows them (``relay/island``).

A relay pushes once for its islands; its push names each (tokens, inner steps, compute seconds, how long
it has been joined at its relay), the root keeps their goodput on the relay's record
(:attr:`~atoll.coordinator.state.membership.IslandRecord.behind`), and the history keeps their figures
round by round. Their state is the root's reading of those:

- ``gone``: the relay's lease ran out;
- ``active``: its work entered the last closed round, or its relay's push for the open round names it;
- ``late``: neither (its relay forwarded rounds without it).
"""

from __future__ import annotations

from atoll.coordinator.state.membership import IslandRecord, IslandState

RECENT_ROUNDS = 100
"""The rounds /api/status reports (its history's, and a relay's islands' figures)."""


def states(s) -> dict[str, str]:
    """The state of every island behind a relay of the run ``s`` (a :class:`RunState`), by name."""
    now = s.clock()
    last = s.history[-1].tokens_by_island if s.history else {}
    out = {}
    for relay, rec in s.membership.islands.items():
        if not rec.relay:
            continue
        committed = s.accumulator.committed.get(relay)
        open_round = {m.named(relay) for m in committed.members} if committed is not None else set()
        for name in sorted(set(rec.behind) | {k for k in last if k.startswith(f"{relay}/")}):
            out[name] = state(rec, now, name in last or name in open_round)
    return out


def state(relay: IslandRecord, now: float, entered_lately: bool) -> str:
    if relay.lease_expires_at <= now:
        return IslandState.GONE
    return IslandState.ACTIVE if entered_lately else IslandState.LATE


def rows(s, relay: str, rec: IslandRecord, now: float, named: dict[str, str]) -> dict[str, dict]:
    """The islands behind ``relay`` (through relays below it too): their state (``named``: from
    :func:`states`) and goodput as the root keeps them, and over the last :data:`RECENT_ROUNDS` rounds
    their tokens, inner steps, compute seconds and the rounds they entered, with their tokens in the last
    of those rounds."""
    history = s.history[-RECENT_ROUNDS:]
    out: dict[str, dict] = {}
    for h in history:
        for key, tokens in h.tokens_by_island.items():
            if key.startswith(f"{relay}/"):
                row = out.setdefault(key, {"last_round_tokens": 0, "tokens": 0, "inner_steps": 0,
                                           "compute_seconds": 0.0, "rounds": 0})  # fmt: skip
                row["tokens"] += tokens
                row["inner_steps"] += h.steps_by_island.get(key, 0)
                row["compute_seconds"] += h.compute_seconds_by_island.get(key, 0.0)
                row["rounds"] += 1
    for key, tokens in (history[-1].tokens_by_island if history else {}).items():
        if key in out:
            out[key]["last_round_tokens"] = tokens
    for key, g in rec.behind.items():
        row = out.setdefault(key, {})
        row.update(
            goodput=g.ratio(now),
            joined_seconds=g.wall(now),
            last_push_age_seconds=None if g.left_at is None else now - g.left_at,
            compute_seconds_into_theta=g.compute_into_theta,
            tokens_into_theta=g.tokens_into_theta,
        )
    for key, row in out.items():
        row["state"] = named.get(key, IslandState.LATE)
    return dict(sorted(out.items()))
