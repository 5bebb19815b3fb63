"""An island's DiLoCo state in a checkpoint: what :meth:`DiLoCo.state_dict` holds, the checks of
:meth:`DiLoCo.load_state_dict`, and how ``start()`` resumes from it (outer state back, an exchange
that was in flight re-pushed, exact-delta catch-up when the run moved on meanwhile)."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from typing import NamedTuple

from atoll.islands._exchanges import Exchanges
from atoll.islands._flight import RoundStats, flight_state, restore_flight
from atoll.islands._messages import JoinAnswer
from atoll.islands._outer_state import OuterState
from atoll.islands._route_table import RouteTable
from atoll.islands._schedule import Schedule
from atoll.islands._transport.session import Session

log = logging.getLogger("atoll.island")
STATE_FORMAT = "atoll-diloco-1"


class Who(NamedTuple):
    """Whose state a checkpoint is: it resumes only the same island and rank of the same run."""

    run_id: str
    island_id: str
    session_id: str
    rank: int
    num_ranks: int


def state_dict(
    who: Who, inner_steps: int, outer: OuterState, sessions: list[Session], schedule: Schedule, exchanges: Exchanges
) -> dict:
    """See :meth:`DiLoCo.state_dict`. A flight's payloads being encoded on its exchange's thread are
    waited for; one whose merge deltas are being made is read before or after, never between."""
    flights = exchanges.in_flight()
    for f in flights:
        f.wait_encoded()
    with contextlib.ExitStack() as held:
        for f in flights:
            held.enter_context(f.lock)
        return _state_dict(who, inner_steps, outer, sessions, schedule, flights)


def _state_dict(
    who: Who, inner_steps: int, outer: OuterState, sessions: list[Session], schedule: Schedule, flights: list
) -> dict:
    states = dict(outer.items())
    snapshots = {k: st.snapshot for k, st in states.items() if st.snapshot is not None}
    deltas = {k: st.merge_delta for k, st in states.items() if st.merge_delta is not None}
    return {
        "format": STATE_FORMAT,
        "run_id": who.run_id,
        "island_id": who.island_id,
        "session_id": who.session_id,
        "rank": who.rank,
        "num_ranks": who.num_ranks,
        "inner_steps": inner_steps,
        "routes": [
            {"round": s.round, "run_complete": s.run_complete, **schedule.routes[s.index].state_dict()}
            for s in sessions
        ],
        "flights": [flight_state(f) for f in flights],
        "shards": {key_str(k): st.state_dict() for k, st in states.items()},
        "snapshots": {key_str(k): t.detach().to("cpu", copy=True) for k, t in snapshots.items()},
        "merge_deltas": {key_str(k): t.detach().to("cpu", copy=True) for k, t in deltas.items()},
    }


def check(who: Who, sd: dict) -> None:
    """ValueError unless ``sd`` is a DiLoCo state of this very island and rank."""
    if sd.get("format") != STATE_FORMAT:
        raise ValueError(f"not a DiLoCo state (format {sd.get('format')!r}, expected {STATE_FORMAT!r})")
    mine = (who.run_id, who.island_id, who.rank, who.num_ranks)
    theirs = (sd["run_id"], sd["island_id"], sd["rank"], sd["num_ranks"])
    if theirs != mine:
        raise ValueError(
            f"the state is of island {theirs[1]!r} rank {theirs[2]}/{theirs[3]} of run {theirs[0]!r}; "
            f"this is island {mine[1]!r} rank {mine[2]}/{mine[3]} of run {mine[0]!r}"
        )


def resume(
    sd: dict,
    table: RouteTable,
    outer: OuterState,
    sessions: list[Session],
    exchanges: Exchanges,
    joined: list[JoinAnswer],
    run_complete: Callable[[], bool],
) -> list[RoundStats]:
    """start() after load_state_dict(): outer state back, flights re-pushed, catch up if behind.
    Returns the stats of the exchanges it finished (a plain one that was in flight, or any, when the
    run is complete: the island then ends holding its final θ, no inner step taken)."""
    states = dict(outer.items())
    keys = {key_str(k): k for k in states}
    if set(keys) != set(sd["shards"]):
        raise ValueError("the saved DiLoCo state is of another model layout (its shards differ)")
    for name, shard_sd in sd["shards"].items():
        state = states[keys[name]]
        state.load_state_dict(shard_sd)
        if name in sd["snapshots"]:
            state.snapshot = state.placement.keep(sd["snapshots"][name].to(state.device))
        if name in sd.get("merge_deltas", {}):
            state.merge_delta = state.placement.keep(sd["merge_deltas"][name].to(state.device))
    counts = sd.get("routes", sd.get("links"))  # "links": a checkpoint of an earlier release
    for s, count_sd in zip(sessions, counts, strict=True):
        s.round = int(count_sd["round"])
        s.run_complete = s.run_complete or bool(count_sd["run_complete"])
    in_flight, finished = set(), []
    over = all(resp.run_complete for resp in joined)  # nothing more to train: no step before it is applied
    for fsd in sd["flights"]:
        flight = restore_flight(fsd)
        in_flight.update(flight.routes)
        flight.merge = flight.merge and not over  # the run's final θ itself, no progress kept on top
        exchanges.launch(flight)
        if not flight.merge:
            finished.append(exchanges.finish(flight, run_complete))
    for s, resp in zip(sessions, joined, strict=True):
        if s.index in in_flight or resp.round <= s.round:
            continue
        # The run moved on while this island was down: its partial round is stale.
        log.warning("%s: the run moved on to round %d meanwhile; catching up", s.me.island_id, resp.round)
        s.pull_until_ready(s.round, on_entry=outer.applier(table.shards(s.index)))
        outer.load_params(table.shards(s.index), merge=False)
        counts[s.index].update(steps=0, tokens=0, losses=[])
    return finished


def key_str(key: tuple) -> str:
    name, offsets, sizes = key
    return f"{name}|{','.join(map(str, offsets))}|{','.join(map(str, sizes))}"
