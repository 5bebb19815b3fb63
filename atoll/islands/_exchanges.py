"""The island's outer exchanges: their owner (:class:`Exchanges`: begin, the I/O, finish), which
sequences calls on the route table, the outer state and the link; one exchange in flight and the
stats of a finished one are :mod:`atoll.islands._flight`.

The I/O of an exchange runs on the training thread, or on a background thread when overlapping; it
never touches a parameter. When overlapping, that thread also does the island's own passes over θ
that need no parameter: it encodes the pseudo-gradient from the snapshot of θ as pushed (while the
training thread trains on), and once the updates are in it checks them and makes each shard's merge
delta, applying them to θ_start (which no step reads). What is left on the training thread is the
snapshot's copy at the push and, at the merge, one add into the parameters: :meth:`Exchanges.finish`.
"""

from __future__ import annotations

import contextlib
import logging
import math
import threading
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

from atoll.islands._flight import Flight, RoundStats
from atoll.islands._link import CoordinatorLink
from atoll.islands._messages import PushHeader
from atoll.islands._outer_state import OuterState
from atoll.islands._route_table import RouteTable
from atoll.islands._schedule import Schedule
from atoll.protos.vocabulary import PushKind, PushOutcome

log = logging.getLogger("atoll.island")


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
        # asked again. Overlapping, θ is kept as pushed (the snapshot) and the exchange's thread encodes
        # it. Otherwise the payloads are encoded now and kept until the exchange is done.
        streamed = not flight.merge and not codec.stateful
        if streamed:
            flight.rebuild = lambda i: outer.encode(table.owned(i), codec)
            flight.encoder = lambda i: outer.encoder(table.owned(i), codec)
        for i in indices:
            owned = table.owned(i)
            if flight.merge:
                outer.take_snapshots(table.shards(i))
            later = streamed or flight.merge  # sizes are known before encoding (push headers declare them)
            payloads = None if later else [flight.kept(p) for p in outer.encode(owned, codec)]
            sizes = [codec.encoded_size(s.sizes) for s in owned] if later else [len(p) for p in payloads]
            flight.max_payload_numel = max([flight.max_payload_numel, *(s.local().numel() for s in owned)])
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
                compute_seconds=compute,
                blocked_seconds=blocked,
            )
            flight.pushes.append((i, header, payloads))
            del payloads
            self.by_route[i] = flight
        self.schedule.synced(indices)
        if flight.merge:
            flight.encode_later = self._encoding(flight, codec, outer.fence())
            flight.encoded.clear()
            flight.go.clear()
            self.launch(flight)  # it encodes, then waits for before_push's answer to push
        try:
            if before_push is not None:  # (a checkpoint's state_dict() waits for the encoding)
                ready = before_push()
                flight.ready = ready if callable(ready) else None
        except BaseException:
            flight.cancelled = True
            raise
        finally:
            flight.go.set()
        flight.host += clock() - started
        if not flight.merge:
            self.launch(flight)
        flight.blocked += clock() - started
        return flight

    def _encoding(self, flight: Flight, codec, snapshots_taken: Callable[[], None]) -> Callable[[], None]:
        """The flight's payloads, encoded from the snapshots of θ as pushed (on the exchange's thread)."""

        def encode() -> None:
            snapshots_taken()
            for k, (i, header, _) in enumerate(flight.pushes):
                payloads = [flight.kept(p) for p in self.outer.encode(self.table.owned(i), codec, pushed=True)]
                declared = [e.num_bytes for e in header.entries]
                if [len(p) for p in payloads] != declared:  # (a codec whose size is not what it said)
                    raise RuntimeError(f"{codec.spec} encoded {[len(p) for p in payloads]} bytes, declared {declared}")
                flight.pushes[k] = (i, header, payloads)

        return encode

    def launch(self, flight: Flight) -> None:
        """Run the flight's I/O: on a background thread when it merges (overlap), else right here."""
        flight.clock = self.schedule.clock
        for i in flight.routes:
            self.by_route[i] = flight
        if flight.merge_ready:  # (restored from a checkpoint) its update is in θ_start: finish() merges it
            return
        if flight.merge:
            # The thread does work the training thread did before (the encoding, the merge's delta):
            # under the same dispatch modes (a FakeTensorMode, a user's tracing mode), as it would have.
            modes = _get_current_dispatch_mode_stack()
            flight.thread = threading.Thread(
                target=self._io_under, args=(flight, modes), name="atoll-exchange", daemon=True
            )
            flight.thread.start()
        else:
            self._io(flight)

    def _io_under(self, flight: Flight, modes: list) -> None:
        with contextlib.ExitStack() as entered:
            for mode in modes:
                entered.enter_context(mode)
            self._io(flight)

    def _io(self, flight: Flight) -> None:
        """Push on every route first, then wait for each shard's outer step; no parameter is touched."""
        sessions, table, outer, link = self.link.sessions, self.table, self.outer, self.link
        began, own = flight.clock(), flight.host  # (only this thread adds to host while it runs)
        try:
            if flight.encode_later is not None:
                try:
                    flight.encode_later()
                except BaseException as err:
                    flight.encode_error = err
                    raise
                finally:
                    flight.background += flight.clock() - began
                    flight.encoded.set()
            flight.go.wait()
            if flight.cancelled:
                return
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
            if flight.thread is not None:
                self._prepare_merge(flight)
        except BaseException as err:  # re-raised in the training loop by finish()
            flight.error = err
        finally:
            flight.exchange = flight.clock() - began - (flight.host - own) - flight.background

    def _prepare_merge(self, flight: Flight) -> None:
        """On the exchange's thread, every update in: check them and make the merge deltas (timed as
        background work). A checkpoint meanwhile waits for the flight's lock."""
        began = flight.clock()
        with flight.lock:
            for i in flight.routes:
                self.outer.prepare_merge(self.table.shards(i), [(h, p) for j, h, p in flight.updates if j == i])
            flight.merge_ready = True
            flight.updates = [(i, h, None) for i, h, _ in flight.updates]  # (in θ_start; headers for _align)
            flight.merge_fence = self.outer.fence()
        flight.background += flight.clock() - began

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
        flight.merge_fence()  # (the deltas made on the exchange's thread: its device work done)
        for i in flight.routes:
            dropped = flight.outcomes.get(i) is PushOutcome.ROUND_CLOSED
            if not flight.merge_ready:
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
