"""Outer exchanges: one in flight (push, wait for the outer step, pull), their owner
(:class:`Exchanges`: begin, the I/O, finish) and the stats of a finished one.

The I/O of an exchange runs on the training thread, or on a background thread when overlapping; it
never touches a parameter. Applying the pulled update is :meth:`Exchanges.finish`, on the training
thread.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from atoll.islands._link import CoordinatorLink
from atoll.islands._messages import Pulled, PushHeader, Update
from atoll.islands._outer_state import OuterState
from atoll.islands._route_table import RouteTable
from atoll.islands._schedule import Schedule
from atoll.islands._transport.convert import push_header_from_wire
from atoll.protos.vocabulary import PushKind, PushOutcome

log = logging.getLogger("atoll.island")


@dataclass
class RoundStats:
    round: int
    """The round this island just finished (its delta was for this round)."""
    inner_steps: int
    tokens: int
    """Tokens the island (all its ranks) processed in the round."""
    loss: float | None
    """Mean of the losses passed to ``step`` during the round."""
    global_loss: float | None
    """Token-weighted mean loss over the islands that committed the round (from the coordinator)."""
    bytes_sent: int
    """Bytes the island (all its ranks) sent in the exchange."""
    bytes_received: int
    sync_seconds: float
    """Seconds the training loop spent on the exchange (encoding, waiting, applying)."""
    update_kind: str
    max_payload_numel: int
    """Largest tensor region this rank encoded in the round (no rank encodes a full sharded tensor)."""
    shards: tuple[int, ...] = ()
    """The coordinator shards (streaming: fragments) this exchange synced."""
    dropped: bool = False
    """The round closed before this island's push arrived: its work did not count."""
    run_complete: bool = False
    """The run reached its total rounds with this exchange: stop training."""
    host_seconds: float = 0.0
    """Of ``sync_seconds``, the training loop's own work, not its waits for the coordinator: the
    pseudo-gradient and its encoding, the checkpoint's start, decoding and applying the update. What
    ``atoll plan --host-seconds`` takes (it is never hidden by overlap); on an accelerator the passes
    over θ run on the device and this is small."""
    exchange_seconds: float = 0.0
    """The exchange's time on the link and at the coordinator: from its start (a checkpoint's write it
    waits for included) to its last update received, the island's own work in it left out; with
    overlap it runs on the exchange's thread while the island trains on. What ``atoll plan`` gives as
    an exchange's sync seconds."""


@dataclass(eq=False)
class Flight:
    routes: list[int]
    """The coordinator shards (their routes) this exchange syncs."""
    round: int
    steps: int
    tokens: int
    loss: float | None
    pushed_at: int
    """``inner_steps`` when it was pushed."""
    merge: bool
    """Overlap: keep the progress made while the exchange was in flight when applying it."""
    bytes0: tuple[int, int] = (0, 0)
    pushes: list[tuple[int, PushHeader, list]] = field(default_factory=list)
    """(route, header, payloads) per route; payloads are dropped once acknowledged when ``rebuild`` can
    encode them again (a coordinator that restarted asks for them)."""
    rebuild: Callable[[int], list] | None = None
    encoder: Callable[[int], Callable[[int], bytes]] | None = None
    """Streamed pushes: ``encoder(route)(j)`` encodes the route's j-th payload as the stream asks."""
    updates: list[tuple[int, Update, list]] = field(default_factory=list)
    """(route, header, payloads) of every update pulled, in order."""
    outcomes: dict[int, PushOutcome] = field(default_factory=dict)
    result: tuple[Pulled | None, float | None] = (None, None)
    max_payload_numel: int = 0
    blocked: float = 0.0
    host: float = 0.0
    """Of ``blocked``, the training thread's own work (:attr:`RoundStats.host_seconds`)."""
    exchange: float = 0.0
    """:attr:`RoundStats.exchange_seconds`."""
    clock: Callable[[], float] = time.monotonic
    """What ``blocked`` and ``host`` are timed by: the island's schedule's (set at :meth:`Exchanges.launch`)."""
    error: BaseException | None = None
    thread: threading.Thread | None = None
    ready: Callable[[], object] | None = None
    """Waited for before the first push (``before_push``'s answer: a checkpoint being written)."""
    leases: list = field(default_factory=list)
    """Its leases on the payloads it pushes (kept for a re-push, or made as a stream asks): none of
    them is encoded into again before it ends (:meth:`end`)."""
    lease_on: Callable[[object], object] | None = None
    """Takes a lease on a payload for this flight."""
    settle: Callable[[list], list] = list
    """``settle(payloads)``: on the host and sealed (a staged encode returns before its copy is done:
    :meth:`Routes.on_host`); every read of the payloads goes through it, on whichever thread reads."""

    def kept(self, payload):
        """``payload``, leased for this flight (it pushes it, and may again)."""
        if self.lease_on is not None:
            self.leases.append(self.lease_on(payload))
        return payload

    def end(self) -> None:
        """The flight is over: what it pushed may be encoded into again."""
        for lease in self.leases:
            lease.release()
        self.leases = []

    def source(self, route: int):
        """What to push for a route: its payloads, or an encoder that makes them one at a time (each
        leased for the flight as it is made)."""
        for i, _, payloads in self.pushes:
            if i == route and payloads is not None:
                return self.settle(payloads)
        if self.encoder is not None:  # (a plain exchange: the stream asks on the training thread)
            route_encoder = self.timed(self.encoder)(route)  # making it is own work, and so is each encode
            encode = self.timed(route_encoder)
            return lambda j: self.kept(encode(j))
        return self.payloads_of(route)

    def timed(self, work: Callable) -> Callable:
        """``work``, its time counted as the training thread's own (:attr:`host`)."""

        def run(*args):
            began = self.clock()
            try:
                return work(*args)
            finally:
                self.host += self.clock() - began

        return run

    def payloads_of(self, route: int) -> list:
        """The route's payloads: kept, or encoded again (the same bytes: see ``rebuild``)."""
        for i, _, payloads in self.pushes:
            if i == route:
                return self.settle(payloads if payloads is not None else [self.kept(p) for p in self.rebuild(route)])
        raise KeyError(route)

    def release_payloads(self) -> None:
        """Drop the payloads once acknowledged, when they can be rebuilt (memory: no second copy of the
        pseudo-gradient while the island waits for the outer step)."""
        if self.rebuild is not None:
            self.pushes = [(i, h, None) for i, h, _ in self.pushes]

    def stats(self, bytes1: tuple[int, int], island_bytes, run_complete: bool) -> RoundStats:
        kind, global_loss = self.result
        sent, received = island_bytes(bytes1[0] - self.bytes0[0], bytes1[1] - self.bytes0[1])
        return RoundStats(
            self.round,
            self.steps,
            self.tokens,
            self.loss,
            global_loss,
            sent,
            received,
            self.blocked,
            kind.value if kind is not None else "",
            self.max_payload_numel,
            tuple(self.routes),
            dropped=any(o is PushOutcome.ROUND_CLOSED for o in self.outcomes.values()),
            run_complete=run_complete,
            host_seconds=self.host,
            exchange_seconds=self.exchange,
        )


def flight_state(f: Flight) -> dict:
    """A flight that was pushed (or is about to be) but not applied, for a checkpoint."""
    return {
        "routes": list(f.routes),
        "round": f.round,
        "steps": f.steps,
        "tokens": f.tokens,
        "loss": f.loss,
        "pushed_at": f.pushed_at,
        "merge": f.merge,
        "pushes": [
            {
                "route": i,
                "header": h.to_json(),
                "payloads": [_bytes_tensor(p) for p in f.payloads_of(i)],
            }
            for i, h, _ in f.pushes
        ],
    }


def restore_flight(sd: dict) -> Flight:
    """The flight of :func:`flight_state`, ready to be pushed again (pushes are idempotent)."""
    flight = Flight(
        routes=[int(i) for i in sd.get("routes", sd.get("links", ()))],  # "links": an earlier release
        round=int(sd["round"]),
        steps=int(sd["steps"]),
        tokens=int(sd["tokens"]),
        loss=sd["loss"],
        pushed_at=int(sd["pushed_at"]),
        merge=bool(sd["merge"]),
    )
    for push in sd["pushes"]:
        saved = push["header"]
        if isinstance(saved, dict):
            header = PushHeader.from_json(saved)
        else:  # a checkpoint of an earlier release holds the header's protobuf form
            header = push_header_from_wire(saved.numpy().tobytes())
        route = int(push.get("route", push.get("link")))  # "link": an earlier release
        flight.pushes.append((route, header, [bytearray(p.numpy().tobytes()) for p in push["payloads"]]))
    return flight


def _bytes_tensor(p) -> torch.Tensor:
    return torch.frombuffer(bytearray(p), dtype=torch.uint8) if len(p) else torch.empty(0, dtype=torch.uint8)


class Exchanges:
    """The island's exchanges in flight, one per route at most (a flight may cover several)."""

    def __init__(
        self,
        table: RouteTable,
        outer: OuterState,
        link: CoordinatorLink,
        schedule: Schedule,
        *,
        overlap: bool,
        align: bool = True,
        group=None,
        token_group=None,
    ) -> None:
        """Exchanges over ``link``'s sessions (route i: session i) of ``table``'s routes, changing
        ``outer``; the run's terms are the link's (it has joined)."""
        self.table, self.outer, self.link = table, outer, link
        self.schedule = schedule
        self.overlap = overlap
        self.align = align
        """Move the pushes by where the coordinator says they landed (decoupled runs: it says so only there)."""
        self.group = group
        self.token_group = token_group
        self.by_route: dict[int, Flight] = {}
        """The exchange in flight per route, if any."""
        me = link.sessions[0].me
        self.rank, self.num_ranks, self.island_id = me.rank, me.num_ranks, me.island_id
        self._warned_tokens = False

    def in_flight(self) -> list[Flight]:
        return list(dict.fromkeys(self.by_route.values()))

    def abandon(self) -> None:
        self.by_route = {}

    def begin(self, indices: list[int], pushed_at: int, before_push: Callable[[], object] | None) -> Flight:
        """Encode the routes' pseudo-gradients and push them (in the background when overlapping).
        ``before_push()`` runs once they are encoded; if it returns a callable, the push waits for it
        (a checkpoint's write: a push the coordinator counts always has a durable checkpoint)."""
        clock = self.schedule.clock
        started = clock()
        table, outer, link, sessions = self.table, self.outer, self.link, self.link.sessions
        codec = link.terms.codec
        count = self.schedule.routes[indices[0]]
        steps, tokens, compute = count.carried  # the work of a dropped push, still in θ
        compute, blocked = compute + count.compute_seconds(started), count.blocked
        flight = Flight(
            routes=indices,
            round=min(sessions[i].round for i in indices),
            steps=steps + count.steps,
            tokens=tokens + self._island_tokens(count.tokens),
            loss=count.mean_loss(),
            pushed_at=pushed_at,
            merge=self.overlap,
            bytes0=link.bytes(indices),
            lease_on=lambda payload: outer.leases.take(payload, f"round {sessions[indices[0]].round}'s push"),
            settle=outer.on_host,
        )
        # A stateless codec (no error feedback, no warm start) on a plain exchange (θ stays put until it
        # is applied) streams: each payload is encoded as the push stream asks for it, and again if
        # asked again. Otherwise the payloads are encoded now and kept until the exchange is done.
        streamed = not flight.merge and not codec.stateful
        if streamed:
            flight.rebuild = lambda i: outer.encode(table.owned(i), codec)
            flight.encoder = lambda i: outer.encoder(table.owned(i), codec)
        for i in indices:
            owned = table.owned(i)
            payloads = None if streamed else [flight.kept(p) for p in outer.encode(owned, codec)]
            sizes = [codec.encoded_size(s.sizes) for s in owned] if streamed else [len(p) for p in payloads]
            flight.max_payload_numel = max([flight.max_payload_numel, *(s.local().numel() for s in owned)])
            if flight.merge:
                outer.take_snapshots(table.shards(i))
            session = sessions[i]
            header = session.header(
                PushKind.DELTA,
                session.round,
                owned,
                sizes,
                codec.spec,
                tokens=flight.tokens,
                loss=flight.loss,
                steps=flight.steps,
            )
            header.compute_seconds, header.blocked_seconds = compute, blocked
            flight.pushes.append((i, header, payloads))
            del payloads
            self.by_route[i] = flight
        self.schedule.synced(indices)
        if before_push is not None:
            ready = before_push()
            flight.ready = ready if callable(ready) else None
        flight.host += clock() - started
        self.launch(flight)
        flight.blocked += clock() - started
        return flight

    def launch(self, flight: Flight) -> None:
        """Run the flight's I/O: on a background thread when it merges (overlap), else right here."""
        flight.clock = self.schedule.clock
        for i in flight.routes:
            self.by_route[i] = flight
        if flight.merge:
            flight.thread = threading.Thread(target=self._io, args=(flight,), name="atoll-exchange", daemon=True)
            flight.thread.start()
        else:
            self._io(flight)

    def _io(self, flight: Flight) -> None:
        """Push on every route first, then wait for each shard's outer step; no parameter is touched."""
        sessions, table, outer, link = self.link.sessions, self.table, self.outer, self.link
        began, own = flight.clock(), flight.host  # (only this thread adds to host while it runs)
        try:
            if flight.ready is not None:
                flight.ready()
            for i, header, _ in flight.pushes:
                flight.outcomes[i] = sessions[i].push(header, flight.source(i))
            flight.release_payloads()
            for i, header, _ in flight.pushes:
                dropped = flight.outcomes[i] is PushOutcome.ROUND_CLOSED
                if dropped:  # re-based on the new θ with the round's progress kept (before any update lands)
                    outer.keep_base(table.shards(i))
                # In the background (overlap) updates are kept and applied by the training thread; on
                # the training thread they are applied entry by entry as they arrive.
                buffered = flight.thread is not None
                flight.result = sessions[i].pull_until_ready(
                    header.round,
                    on_update=(lambda h, pl, i=i: flight.updates.append((i, h, pl))) if buffered else None,
                    on_entry=None if buffered else flight.timed(outer.applier(table.shards(i))),
                    repush=None if dropped else (lambda i=i, h=header: (h, flight.source(i))),
                    cancel=link.stopping,
                )
        except BaseException as err:  # re-raised in the training loop by finish()
            flight.error = err
        finally:
            flight.exchange = flight.clock() - began - (flight.host - own)

    def finish(self, flight: Flight, run_complete: Callable[[], bool]) -> RoundStats:
        """Wait for the exchange (if in the background) and apply its outer update(s)."""
        clock = self.schedule.clock
        started = clock()
        if flight.thread is not None:
            flight.thread.join()
            flight.thread = None
        applying = clock()
        for i in flight.routes:
            self.by_route.pop(i, None)
        flight.end()  # its payloads may be encoded into again
        if flight.error is not None:
            raise flight.error
        by_route: dict[int, list] = {}
        for i, header, payloads in flight.updates:
            by_route.setdefault(i, []).append((header, payloads))
        headers = {i: h for i, h, _ in flight.pushes}
        for i in flight.routes:
            dropped = flight.outcomes.get(i) is PushOutcome.ROUND_CLOSED
            self.outer.apply_all(self.table.shards(i), by_route.get(i, []))
            self.outer.load_params(self.table.shards(i), merge=flight.merge or dropped)
            self._align(i, headers.get(i), [h for h, _ in by_route.get(i, [])])
            if dropped:  # what the push said it covers (also for a flight restored from a checkpoint)
                h = headers[i]
                self.schedule.routes[i].carry(h.inner_steps, h.tokens, h.compute_seconds)
        flight.updates = []
        flight.host += clock() - applying
        flight.blocked += clock() - started
        return flight.stats(self.link.bytes(flight.routes), self._island_bytes, run_complete())

    def _align(self, route: int, pushed: PushHeader | None, updates: list) -> None:
        """Decoupled: move the route's next pushes by where this push landed in its round, as the
        coordinator said with the round's update (:meth:`RouteCount.aligned`)."""
        if pushed is None or pushed.inner_steps <= 0 or not self.align or not self.link.terms.decoupled:
            return  # (a sync run's updates carry no offset: its ranks take no collective for one)
        offsets = [u.arrival_offset for u in updates if u.arrival_offset is not None]
        offset, step_seconds = offsets[0] if offsets else -math.inf, pushed.compute_seconds / pushed.inner_steps
        if self.num_ranks > 1:  # the ranks' clocks differ: they agree on one shift, or their steps part
            t = torch.tensor([offset, step_seconds], dtype=torch.float64, device=self._device())
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
            offset, step_seconds = t.tolist()
        if math.isfinite(offset):
            self.schedule.routes[route].aligned(offset, step_seconds, self.schedule.sync_every)

    def _island_tokens(self, tokens: int) -> int:
        """The island's tokens: this rank's summed over the token group (one all-reduce per sync)."""
        if self.num_ranks > 1:
            t = torch.tensor([float(tokens)], dtype=torch.float64, device=self._device())
            dist.all_reduce(t, group=self.token_group if self.token_group is not None else self.group)
            tokens = int(t.item())
        if tokens == 0 and not self._warned_tokens and self.rank == 0:
            log.warning(
                "%s: step() got no tokens=; the coordinator weighs this island's delta by its inner steps "
                "times the other islands' tokens per step (pass the tokens each step processed)",
                self.island_id,
            )
            self._warned_tokens = True
        return tokens

    def _island_bytes(self, sent: int, received: int) -> tuple[int, int]:
        """The island's bytes of a round: every rank's, summed."""
        if self.num_ranks == 1:
            return sent, received
        t = torch.tensor([float(sent), float(received)], dtype=torch.float64, device=self._device())
        dist.all_reduce(t, group=self.group)
        return int(t[0].item()), int(t[1].item())

    def _device(self) -> torch.device:
        return self.table.routes[0][0].local().device
