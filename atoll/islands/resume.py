"""An island's DiLoCo state in a checkpoint: what :meth:`DiLoCo.state_dict` holds, the checks of
:meth:`DiLoCo.load_state_dict`, and how ``start()`` resumes from it (outer state back, an exchange
that was in flight re-pushed, exact-delta catch-up when the run moved on meanwhile)."""

from __future__ import annotations

import logging
import threading

from atoll.islands.flight import flight_state, restore_flight
from atoll.protos import coordinator_pb2 as pb

log = logging.getLogger("atoll.island")
STATE_FORMAT = "atoll-diloco-1"


def state_dict(sync) -> dict:
    """See :meth:`DiLoCo.state_dict`."""
    links = sync.links
    snapshots = {k: st.snapshot for k, st in links.states.items() if st.snapshot is not None}
    return {
        "format": STATE_FORMAT,
        "run_id": sync.run_id,
        "island_id": sync.island_id,
        "session_id": sync.session_id,
        "rank": sync.rank,
        "num_ranks": sync.num_ranks,
        "inner_steps": sync.inner_steps,
        "links": [
            {"round": s.round, "run_complete": s.run_complete, **sync.schedule.links[s.index].state_dict()}
            for s in sync.sessions
        ],
        "flights": [flight_state(f) for f in sync._in_flight()],
        "shards": {key_str(k): st.state_dict() for k, st in links.states.items()},
        "snapshots": {key_str(k): t.detach().to("cpu", copy=True) for k, t in snapshots.items()},
    }


def check(sync, sd: dict) -> None:
    """ValueError unless ``sd`` is a DiLoCo state of this very island and rank."""
    if sd.get("format") != STATE_FORMAT:
        raise ValueError(f"not a DiLoCo state (format {sd.get('format')!r}, expected {STATE_FORMAT!r})")
    mine = (sync.run_id, sync.island_id, sync.rank, sync.num_ranks)
    theirs = (sd["run_id"], sd["island_id"], sd["rank"], sd["num_ranks"])
    if theirs != mine:
        raise ValueError(
            f"the state is of island {theirs[1]!r} rank {theirs[2]}/{theirs[3]} of run {theirs[0]!r}; "
            f"this is island {mine[1]!r} rank {mine[2]}/{mine[3]} of run {mine[0]!r}"
        )


def resume_links(sync, sd: dict, joined: list[pb.JoinResponse]) -> None:
    """start() after load_state_dict(): outer state back, flights re-pushed, catch up if behind."""
    links = sync.links
    keys = {key_str(k): k for k in links.states}
    if set(keys) != set(sd["shards"]):
        raise ValueError("the saved DiLoCo state is of another model layout (its shards differ)")
    for name, shard_sd in sd["shards"].items():
        state = links.states[keys[name]]
        state.load_state_dict(shard_sd)
        if name in sd["snapshots"]:
            state.snapshot = state.placement.keep(sd["snapshots"][name].to(state.device))
    for s, link_sd in zip(sync.sessions, sd["links"], strict=True):
        s.round = int(link_sd["round"])
        s.run_complete = s.run_complete or bool(link_sd["run_complete"])
    in_flight = set()
    for fsd in sd["flights"]:
        flight = restore_flight(fsd, sync.sessions)
        in_flight.update(flight.links)
        for i in flight.links:
            sync.flights[i] = flight
        if flight.merge:
            flight.thread = threading.Thread(target=sync._exchange_io, args=(flight,), daemon=True)
            flight.thread.start()
        else:
            sync._exchange_io(flight)
            sync._finish(flight)
    for s, resp in zip(sync.sessions, joined, strict=True):
        if s.index in in_flight or resp.round <= s.round:
            continue
        # The run moved on while this island was down: its partial round is stale.
        log.warning("%s: the run moved on to round %d meanwhile; catching up", sync.island_id, resp.round)
        s.pull_until_ready(s.round, on_entry=links.entry_applier(s.index))
        links.load_params(s.index, merge=False)
        sd["links"][s.index].update(steps=0, tokens=0, losses=[])


def key_str(key: tuple) -> str:
    name, offsets, sizes = key
    return f"{name}|{','.join(map(str, offsets))}|{','.join(map(str, sizes))}"
