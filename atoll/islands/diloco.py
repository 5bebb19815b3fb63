"""The DiLoCo wrapper an island drops into its training loop.

    with DiLoCo(model, inner_opt, coordinator="host:port", codec="int8") as sync:   # joins; same θ everywhere
        for x, y in batches:
            loss = loss_fn(model(x), y); loss.backward(); inner_opt.step(); inner_opt.zero_grad()
            sync.step(tokens=x.numel(), loss=loss.item())   # every H steps: push Δ, pull θ
            if sync.run_complete:
                break
    # leaving the block leaves the run (also on Ctrl-C or an exception)

Works unchanged on a plain module, an FSDP2 (``fully_shard``) module, a tensor-parallel
(``parallelize_module``) module or a 2-D mesh of both, on any device: every rank pushes and pulls
only its own shards (:mod:`shards`), forms and encodes its pseudo-gradient on the parameters'
device and keeps its outer state where ``outer_state`` says (:mod:`exchange`). The links to the
coordinator are :mod:`links`, when each is due :mod:`schedule`, an exchange in flight :mod:`flight`.
The constructor does no network I/O; ``start()`` does (and is collective over the island's
process group).
"""

from __future__ import annotations

import logging
import threading
import time
import uuid

import torch
import torch.distributed as dist

from atoll.islands import resume
from atoll.islands.client import ClientTls, RetryPolicy
from atoll.islands.flight import Flight, RoundStats
from atoll.islands.links import Links
from atoll.islands.options import IslandOptions
from atoll.islands.schedule import Schedule
from atoll.islands.session import Identity
from atoll.islands.shards import LocalShard, local_shards
from atoll.protos import coordinator_pb2 as pb

log = logging.getLogger("atoll.island")


class DiLoCo:
    def __init__(
        self,
        model: torch.nn.Module,
        inner_optimizer: torch.optim.Optimizer | None,
        *,
        coordinator: str,
        sync_every: int | None = None,
        codec: str | None = None,
        run_id: str = "atoll",
        island_id: str | None = None,
        process_group=None,
        heartbeat_seconds: float = 5.0,
        pull_wait_seconds: float = 10.0,
        retry: RetryPolicy | None = None,
        connect_timeout_seconds: float = 120.0,
        keep_last_delta: bool = False,
        sync_every_seconds: float | None = None,
        client_factory=None,
        token: str | None = None,
        tls: ClientTls | None = None,
        overlap_steps: int = 0,
        streaming: bool = False,
        outer_state: str = "host",
        sync_buffers: bool = True,
        token_group=None,
        before_push=None,
    ) -> None:
        """``coordinator``: ``host:port``, or its shards comma-separated (ValueError when malformed).
        ``sync_every``: H for this island; the run's H is used when None, and a different value is
        warned about. ``codec``: a codec name insists on the run's codec being that one; a spec with
        parameters (``"int8:block=64"``) must match the run's exactly.
        ``connect_timeout_seconds``: how long ``start()`` tries to reach the coordinator before it
        raises (a WARNING is logged within seconds of the first failure, then every 30 s).
        ``sync_every_seconds``: sync on a time budget instead of every H steps (adaptive inner steps:
        a slow island does fewer steps; its delta is weighted by the tokens it reports).
        ``client_factory(address, retry=..., token=..., tls=...)``: builds the coordinator client (fault
        injection wraps it). ``token``: this island's bearer token; ``tls``: TLS / mutual TLS settings.

        ``overlap_steps`` τ > 0: push and pull in the background and keep training; the outer update
        is applied τ inner steps after the push (waiting only if it has not arrived by then), keeping
        the progress made meanwhile: θ ← θ_global + (θ_now − θ_at_push) (one-step-delayed outer
        update). 0 is plain DiLoCo, exactly. ``streaming``: the coordinator shards are the fragments
        of Streaming DiLoCo (contiguous blocks of layers, balanced by size; start the coordinator with
        ``--fragments P``) and fragment p syncs on its own staggered schedule, first after
        ⌈(p+1)·H/P⌉ steps, then every H, so each sync moves about 1/P of the model.

        ``outer_state``: where the round-start θ, error-feedback residuals and overlap snapshots live:
        ``"host"`` (default; pinned memory on CUDA, so the accelerator holds no extra model copy) or
        ``"device"``. ``sync_buffers``: floating-point buffers (BatchNorm statistics) are averaged over
        the islands each round; every island of a run must choose the same.
        ``token_group``: the ranks whose ``tokens`` add up to the island's (default: the island's
        whole group; under tensor parallelism pass the data-parallel group, whose ranks see different
        data). ``before_push(sync)``: called on the training thread once a round's pseudo-gradients are
        encoded and before they are sent: the moment to checkpoint the island (its ``state_dict()``
        then holds the payloads, so a resumed island re-pushes them and does not redo the round)."""
        self.options = IslandOptions(
            coordinator=coordinator,
            run_id=run_id,
            sync_every=sync_every,
            codec=codec,
            heartbeat_seconds=heartbeat_seconds,
            pull_wait_seconds=pull_wait_seconds,
            retry=retry,
            connect_timeout_seconds=connect_timeout_seconds,
            sync_every_seconds=sync_every_seconds,
            overlap_steps=overlap_steps,
            streaming=streaming,
            outer_state=outer_state,
            sync_buffers=sync_buffers,
            keep_last_delta=keep_last_delta,
            token=token,
            tls=tls,
            client_factory=client_factory,
            before_push=before_push,
        )
        distributed = dist.is_available() and dist.is_initialized()
        if distributed and island_id is None:
            raise ValueError("a multi-rank island needs an explicit island_id shared by its ranks")
        self.model = model
        self.inner_optimizer = inner_optimizer
        self.run_id = run_id
        self.island_id = island_id or f"island-{uuid.uuid4().hex[:8]}"
        self.session_id = uuid.uuid4().hex
        self.group = process_group
        self.token_group = token_group
        self.rank = dist.get_rank(process_group) if distributed else 0
        self.num_ranks = dist.get_world_size(process_group) if distributed else 1
        self.inner_steps = 0
        self.history: list[RoundStats] = []
        self.last_delta: dict[tuple, torch.Tensor] = {}
        self.links: Links | None = None
        self.shards: list[LocalShard] = []
        self.flights: dict[int, Flight] = {}
        """The exchange in flight per link (overlap), if any."""
        self.schedule: Schedule | None = None
        self._resume: dict | None = None
        self._warned_tokens = False

    # ---- lifecycle -------------------------------------------------------------------------
    def start(self) -> DiLoCo:
        """Join the run and load the global θ into the model (or, after ``load_state_dict``, resume)."""
        self.shards = local_shards(self.model, self.group, buffers=self.options.sync_buffers)
        if not self.shards:
            raise ValueError("the model has no parameters to sync")
        if self.num_ranks > 1:  # one session id for the island's ranks: rank 0's
            shared = [self.session_id]
            src = dist.get_global_rank(self.group, 0) if self.group is not None else 0
            dist.broadcast_object_list(shared, src=src, group=self.group)
            self.session_id = shared[0]
        me = Identity(self.run_id, self.island_id, self.session_id, self.rank, self.num_ranks)
        links = Links(self.options, self.shards, me, self.group)
        self.schedule = Schedule(
            len(links.sessions), streaming=self.options.streaming, sync_every_seconds=self.options.sync_every_seconds
        )
        try:
            joined = links.join_all()
            if self._resume is not None:
                self.links = links
                resume.resume_links(self, self._resume, joined)
            else:
                for s, resp in zip(links.sessions, joined, strict=True):
                    if resp.bootstrap:
                        links.bootstrap(s)
                for s in links.sessions:
                    links.pull_theta(s)
        except BaseException:
            links.close(leave=False)  # a failed start must not keep the island alive on the coordinator
            self.links = None
            raise
        self.links = links
        self.schedule.begin(links.sync_every)
        if self._resume is not None:
            for count, sd in zip(self.schedule.links, self._resume["links"], strict=True):
                count.load_state_dict(sd)
            self._resume = None
        return self

    def __enter__(self) -> DiLoCo:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def sync_every(self) -> int:
        """H: inner steps per round (the run's, once started)."""
        return self.links.sync_every if self.links else (self.options.sync_every or 0)

    @property
    def codec(self):
        """The codec this island pushes with (the run's, once started)."""
        return self.links.codec if self.links else None

    @property
    def sessions(self):
        return self.links.sessions if self.links else []

    @property
    def round(self) -> int:
        """The round this island works on (the oldest over coordinator shards; -1 before start)."""
        return min((s.round for s in self.sessions), default=-1)

    @property
    def rounds_pushed(self) -> int:
        """Rounds pushed since start() (the fewest over coordinator shards / fragments)."""
        return min((c.pushed for c in self.schedule.links), default=0) if self.schedule else 0

    @property
    def round_steps(self) -> int:
        """Inner steps taken so far in the current round (of the oldest shard / fragment)."""
        if not self.sessions:
            return 0
        oldest = min(range(len(self.sessions)), key=lambda i: self.sessions[i].round)
        return self.schedule.links[oldest].steps

    @property
    def run_complete(self) -> bool:
        """The run reached its total rounds (``atoll coordinator --total-rounds``) and this island holds
        the final θ: stop training. ``step()`` does nothing more once it is set."""
        return bool(self.sessions) and all(s.run_complete for s in self.sessions) and not self.flights

    def close(self, leave: bool = True) -> None:
        """Leave the run. An exchange still in flight is abandoned (call ``drain()`` first to wait
        for it and apply it)."""
        if self.links is None:
            return
        self.links.stopping.set()
        if self.flights:
            log.warning("%s: closing with round %d's exchange in flight; abandoned", self.island_id, self.round)
            self.flights = {}
        self.links.close(leave)
        self.links = None

    # ---- training loop ---------------------------------------------------------------------
    def step(self, tokens: int = 0, loss: float | None = None) -> RoundStats | None:
        """Call after each inner optimizer step. Returns a round's stats when one completed (its
        outer update was applied: at the sync, or ``overlap_steps`` later when overlapping).

        ``tokens``: tokens this rank processed in the step; the island's count is their sum over
        ``token_group`` (all ranks, by default), taken once per sync. ``loss``: this step's loss.
        """
        if self.links is None:
            raise RuntimeError("DiLoCo.start() was not called")
        self.inner_steps += 1
        self.schedule.count(tokens, loss)
        done = None
        for flight in self._in_flight():
            if self.inner_steps - flight.pushed_at >= self.options.overlap_steps:
                done = self._finish(flight)
        if self.run_complete:
            return done
        due = self._due_links()
        if due:
            flight = self._begin(due)
            if not self.options.overlap_steps:
                done = self._finish(flight)
        return done

    def _in_flight(self) -> list[Flight]:
        return list(dict.fromkeys(self.flights.values()))

    def _due_links(self) -> list[int]:
        if self.options.sync_every_seconds is None:
            due = self.schedule.due_by_steps(set(self.flights))
            return [i for i in due if not self.sessions[i].run_complete]
        due = self.schedule.budget_spent()
        if self.num_ranks > 1:  # the island's ranks must agree on when to sync
            flag = torch.tensor([1.0 if due else 0.0], device=self.shards[0].local().device)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
            due = bool(flag.item())
        if not due:
            return []
        for flight in self._in_flight():  # the budget is up with the last one still out
            self._finish(flight)
        return list(range(len(self.sessions)))

    def sync(self) -> RoundStats:
        """Push this round's pseudo-gradient to every shard, wait for the outer step and apply it
        (whatever ``overlap_steps`` says; an exchange already in flight is finished first)."""
        self.drain()
        return self._finish(self._begin(list(range(len(self.sessions)))))

    def drain(self) -> list[RoundStats]:
        """Wait for the exchanges in flight and apply them (at the end of training)."""
        return [self._finish(f) for f in self._in_flight()]

    def _island_tokens(self, tokens: int) -> int:
        """The island's tokens: this rank's summed over the token group (one all-reduce per sync)."""
        if self.num_ranks > 1:
            t = torch.tensor([float(tokens)], dtype=torch.float64, device=self.shards[0].local().device)
            dist.all_reduce(t, group=self.token_group if self.token_group is not None else self.group)
            tokens = int(t.item())
        if tokens == 0 and not self._warned_tokens and self.rank == 0:
            log.warning(
                "%s: step() got no tokens=; this island's delta weighs 1 in the mean against the other "
                "islands' token counts (pass the tokens each step processed)",
                self.island_id,
            )
            self._warned_tokens = True
        return tokens

    def _begin(self, indices: list[int]) -> Flight:
        """Encode the links' pseudo-gradients and push them (in the background when overlapping)."""
        started = time.perf_counter()
        links = self.links
        count = self.schedule.links[indices[0]]
        tokens = self._island_tokens(count.tokens)
        flight = Flight(
            links=indices,
            round=min(self.sessions[i].round for i in indices),
            steps=count.steps,
            tokens=tokens,
            loss=count.mean_loss(),
            pushed_at=self.inner_steps,
            merge=bool(self.options.overlap_steps),
            bytes0=links.bytes(indices),
        )
        # A stateless codec (no error feedback, no warm start) on a plain exchange (θ stays put until it
        # is applied) streams: each payload is encoded as the push stream asks for it, and again if
        # asked again. Otherwise the payloads are encoded now and kept until the exchange is done.
        streamed = not flight.merge and not links.codec.stateful
        if streamed:
            flight.rebuild, flight.encoder = links.encode, links.encoder
        for i in indices:
            owned = links.owned(i)
            if self.options.keep_last_delta:
                self.last_delta.update({s.key: links.states[s.key].delta() for s in owned})
            payloads = None if streamed else links.encode(i)
            sizes = links.sizes(i) if streamed else [len(p) for p in payloads]
            flight.max_payload_numel = max([flight.max_payload_numel, *(s.local().numel() for s in owned)])
            if flight.merge:
                for s in links.link_shards[i]:
                    links.states[s.key].take_snapshot()
            session = self.sessions[i]
            header = session.header(
                pb.PUSH_KIND_DELTA,
                session.round,
                owned,
                sizes,
                links.codec.spec,
                tokens=tokens,
                loss=flight.loss,
                steps=flight.steps,
            )
            flight.pushes.append((i, header, payloads))
            del payloads
            self.flights[i] = flight
        self.schedule.synced(indices)
        if self.options.before_push is not None:
            self.options.before_push(self)
        if flight.merge:
            flight.thread = threading.Thread(
                target=self._exchange_io, args=(flight,), name="atoll-exchange", daemon=True
            )
            flight.thread.start()
        else:
            self._exchange_io(flight)
        flight.blocked += time.perf_counter() - started
        return flight

    def _exchange_io(self, flight: Flight) -> None:
        """Push to every link first, then wait for each shard's outer step; no parameter is touched."""
        try:
            for i, header, _ in flight.pushes:
                flight.outcomes[i] = self.sessions[i].push(header, flight.source(i))
            flight.release_payloads()
            for i, header, _ in flight.pushes:
                dropped = flight.outcomes[i] == pb.PUSH_OUTCOME_ROUND_CLOSED
                # In the background (overlap) updates are kept and applied by the training thread; on
                # the training thread they are applied entry by entry as they arrive.
                buffered = flight.thread is not None
                flight.result = self.sessions[i].pull_until_ready(
                    header.round,
                    on_update=(lambda h, pl, i=i: flight.updates.append((i, h, pl))) if buffered else None,
                    on_entry=None if buffered else self.links.entry_applier(i),
                    repush=None if dropped else (lambda i=i, h=header: (h, flight.source(i))),
                    cancel=self.links.stopping,
                )
        except BaseException as err:  # re-raised in the training loop by _finish
            flight.error = err

    def _finish(self, flight: Flight) -> RoundStats:
        """Wait for the exchange (if in the background) and apply its outer update(s)."""
        started = time.perf_counter()
        if flight.thread is not None:
            flight.thread.join()
            flight.thread = None
        for i in flight.links:
            self.flights.pop(i, None)
        if flight.error is not None:
            raise flight.error
        by_link: dict[int, list] = {}
        for i, header, payloads in flight.updates:
            by_link.setdefault(i, []).append((header, payloads))
        for i in flight.links:
            self.links.apply_all(i, by_link.get(i, []))
            self.links.load_params(i, merge=flight.merge)
        flight.updates = []
        flight.blocked += time.perf_counter() - started
        stats = flight.stats(self.links.bytes(flight.links), self._island_bytes, self.run_complete)
        self.history.append(stats)
        return stats

    def _island_bytes(self, sent: int, received: int) -> tuple[int, int]:
        """The island's bytes of a round: every rank's, summed."""
        if self.num_ranks == 1:
            return sent, received
        t = torch.tensor([float(sent), float(received)], dtype=torch.float64, device=self.shards[0].local().device)
        dist.all_reduce(t, group=self.group)
        return int(t[0].item()), int(t[1].item())

    def global_params(self) -> dict[str, torch.Tensor]:
        """This rank's regions of θ for the current round, as received (fp32), keyed by name."""
        return {s.name: self.links.states[s.key].start for s in self.shards}

    # ---- checkpoints (atoll.islands.resume) ----------------------------------------------
    def state_dict(self) -> dict:
        """This rank's DiLoCo state, for a checkpoint of the island: rounds, steps and tokens into
        the round, round-start θ, error-feedback residuals and codec state, and an exchange that was
        pushed but not applied yet (its payloads, so a resumed island re-pushes the same bytes).
        Tensors are CPU copies; save it with the model and inner optimizer (torch.save, or one entry
        per rank beside a torch.distributed.checkpoint of the model)."""
        if self.links is None:
            raise RuntimeError("state_dict() needs a started DiLoCo")
        return resume.state_dict(self)

    def load_state_dict(self, sd: dict) -> None:
        """Restore a state from :meth:`state_dict` before ``start()``: start() then rejoins (with the
        same session, so a restarted process is not taken for a second one), re-pushes an exchange that
        was in flight (idempotent) and catches up by exact deltas if the run moved on."""
        if self.links is not None:
            raise RuntimeError("load_state_dict() goes before start()")
        resume.check(self, sd)
        self.session_id = sd["session_id"]
        self.inner_steps = int(sd["inner_steps"])
        self._resume = sd
