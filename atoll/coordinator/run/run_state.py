"""The coordinator's run: builds the objects that own its state and sequences them.

Transport-independent (no protobuf, no gRPC): requests and answers are :mod:`messages`, refusals
:class:`~atoll.coordinator.errors.RequestError`. Who owns what:

- :class:`~atoll.coordinator.state.membership.Membership`: islands, leases, sessions, departures, the bootstrap claim;
- :class:`~atoll.coordinator.state.accumulator.RoundAccumulator`: staged, held and committed pushes, the
  round's sum, the in-flight budget, open streams;
- :class:`~atoll.coordinator.state.model.GlobalModel`: θ, specs, buffers, outer optimizer, downlink EF,
  the tensor workers;
- :class:`~atoll.coordinator.state.ledger.Ledger`: the open round, history, the sealed round, wake-ups;
- :class:`~atoll.coordinator.state.downlink.Downlink`: the latest encoded update and the kept ones.

:mod:`pushes` and :mod:`pulls` act on those; :mod:`decider` is the decider task; :mod:`saved` makes a
snapshot of the owners and checks one a restart loads. θ_0 and every round take ONE path: sealed
(:meth:`Ledger.seal`) -> :meth:`RunState.try_publish` (make it durable, then publish): θ_0 as a
snapshot, a round as its log record (:mod:`atoll.coordinator.disk.wal`); the optimizer state and the
snapshots every ``snapshot_every`` rounds are written after the publish, in the background. Waiting
pulls get a round's update while its step makes it and its record is written, and their confirmation
once it is published (:meth:`Pulls._tentative`).

Locking rule. Every piece of run state is read and written on the event loop, so a synchronous method
(join, heartbeat, leave, evict, set_operational, planning a push, a pull's bookkeeping) runs without
interleaving and takes no lock. ``lock`` serialises the coroutines that await a worker thread *in the
middle of* changing the round's sum, θ or the ledger: committing a push (:meth:`commit_push`), closing a
round (:meth:`close_round`) and saving/publishing one (:meth:`try_publish`). While one of them holds it,
none of the others starts. Worker threads get the tensors and payloads they work on as arguments and
never change this object. A push's commit runs to its end even when its call is cancelled: a cancelled
await would let the lock go mid-decode.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from pathlib import Path

from atoll.coordinator.config import RunConfig, apply_operational
from atoll.coordinator.disk import wal
from atoll.coordinator.disk.lock import StateLock
from atoll.coordinator.disk.snapshots import Snapshot
from atoll.coordinator.disk.store import LocalState, StateStore
from atoll.coordinator.disk.writer import StateWriter
from atoll.coordinator.messages import (
    Admission,
    IslandCall,
    JoinRequest,
    PullAnswer,
    PullRequest,
    PushHeader,
    PushResult,
)
from atoll.coordinator.policy import grace, phase
from atoll.coordinator.policy.goodput import run_goodput
from atoll.coordinator.policy.rounds import RoundPolicy
from atoll.coordinator.run import saved
from atoll.coordinator.run.islands import Islands
from atoll.coordinator.run.options import LimitsOptions, PlacementOptions, StorageOptions
from atoll.coordinator.run.owners import Owners
from atoll.coordinator.run.pulls import Pulls, wait_event
from atoll.coordinator.run.pushes import Pushes
from atoll.coordinator.run.upstream import Upstream
from atoll.coordinator.state.accumulator import RoundAccumulator
from atoll.coordinator.state.budget import Reservation
from atoll.coordinator.state.downlink import Downlink
from atoll.coordinator.state.ledger import BOOTSTRAP, SAVE_RETRY_SECONDS, Ledger, Sealed
from atoll.coordinator.state.membership import Membership, island_state
from atoll.coordinator.state.model import GlobalModel
from atoll.coordinator.state.plans import PushPlan, Received, StagedRank, release
from atoll.coordinator.state.record import RoundRecord
from atoll.coordinator.state.workers import TensorWorkers
from atoll.protos.vocabulary import PushKind, PushOutcome

log = logging.getLogger("atoll.coordinator")

SEAL_WAIT_SECONDS = 30.0
"""How long a late delta waits for a sealed round's save before it is dropped (the save keeps failing)."""


class RunState:
    def __init__(
        self,
        config: RunConfig,
        state_dir: Path,
        *,
        clock: Callable[[], float] = time.monotonic,
        placement: PlacementOptions | None = None,
        storage: StorageOptions | None = None,
        limits: LimitsOptions | None = None,
        given: frozenset[str] | None = None,
        name: str = "",
        store: StateStore | None = None,
    ) -> None:
        """``placement``: this coordinator's shard and how tensors map to shards; ``storage``: snapshots
        and the store's lease; ``limits``: what it holds at once (:mod:`atoll.coordinator.run.options`).
        ``given``: the config fields the operator set (None: all); on a restart the stored run's math
        must match them and its operational fields take them. ``name``: prefix of this coordinator's
        log lines ("fragment 1/4: "), empty when it is alone. ``store``: where the state is kept
        (:mod:`~atoll.coordinator.disk.store`; default: ``state_dir`` itself; an object store's makes
        ``state_dir`` its working copy)."""
        placement, storage, limits = (
            placement or PlacementOptions(),
            storage or StorageOptions(),
            limits or LimitsOptions(),
        )
        self.placement = placement
        self.shard, self.partition = placement.shard, placement.partition
        self.keep_snapshots = storage.keep_snapshots
        self.state_dir = Path(state_dir)
        self.clock = clock
        self.config = config
        self.given = given
        self.name = name
        self.membership = Membership(clock, lambda: self.config.lease_seconds)
        self.model = GlobalModel(config, TensorWorkers(limits.workers()))  # (its threads decode the pushes too)
        self.accumulator = RoundAccumulator(limits.max_inflight_bytes, self.model.workers)
        self.ledger = Ledger(clock())
        self.downlink = Downlink(self.state_dir, max_pull_bytes=limits.max_pull_bytes)
        self.store = store or LocalState()
        self.writer = StateWriter(
            self.state_dir,
            every=storage.snapshot_every,
            keep=storage.keep_snapshots,
            store=self.store,
            exact=storage.exact_failover,
        )
        owners = self.owners = Owners(lambda: self.config, self.membership, self.accumulator, self.model, self.ledger)
        self.islands = Islands(owners, placement, self.state_dir, name)
        self.pushes = Pushes(owners, clock=clock, name=name)
        self.pulls = Pulls(
            owners, downlink=self.downlink, waiting=lambda: self.waiting, stalled=lambda: self.stall is not None
        )
        self.problem: str | None = None
        """Why the coordinator is unhealthy (a save failing), None when it is well."""
        self.stall: str | None = None
        """Why the open round cannot close, with what would unblock it; None when it can."""
        self.waiting = ""
        """What the open round waits for (the decider's last reason), for people."""
        self.lock = asyncio.Lock()
        self._dir_lock: StateLock | None = None
        self.upstream: Upstream | None = None
        """A relay's upstream (:mod:`atoll.coordinator.run.upstream`); None at the root."""

    # ---- what the run is -----------------------------------------------------------------------
    @property
    def round(self) -> int:
        return self.ledger.round

    @property
    def history(self) -> list[RoundRecord]:
        return self.ledger.history

    @property
    def run_complete(self) -> bool:
        return self.ledger.complete(self.config.total_rounds)

    def finished(self) -> bool:
        """The run is complete and no live island still waits for its final θ (each holds it, or left)."""
        return self.run_complete and all(r.holds_round >= self.round for r in self.membership.live())

    def unhealthy(self) -> str | None:
        """Why the coordinator is unhealthy (/healthz): a save failing, its store or background writes."""
        return self.problem or self.writer.trouble

    def policy(self) -> RoundPolicy:
        c = self.config
        return RoundPolicy(
            quorum=c.quorum,
            deadline_seconds=c.round_deadline_seconds,
            grace=grace.parse(c.grace_window),
            decoupled=c.outer_mode == "decoupled",
        )

    def states(self) -> dict[str, str]:
        """Every island's state (joining / active / late / gone / left / evicted)."""
        now = self.clock()
        out = {i: island_state(rec, now, self.round) for i, rec in self.membership.islands.items()}
        out.update({i: how for i, how in self.membership.departed.items() if i not in out})
        return dict(sorted(out.items()))

    # ---- lifecycle -------------------------------------------------------------------------------
    def restore(self, preloaded: Snapshot | None = None) -> bool:
        """Load the newest verified snapshot and the log after it; True if there was one. StateError /
        ConfigMismatch (one line each) when the state dir cannot be trusted or does not fit the config.
        ``preloaded``: that state, verified and in memory already (a standby's, which followed the
        store: :mod:`atoll.coordinator.disk.follow`); it is taken over, not copied."""
        self.store.check(self.state_dir)  # (a dir that is not an object store's working copy: refused untouched)
        if self._dir_lock is None:  # one writer per state dir, from here until close()
            self._dir_lock = StateLock(self.state_dir).acquire("starting a coordinator on it")
        try:
            self.store.open(self.state_dir, self.config.run_id)  # (an object store's lease: one writer per run)
            return self._restore(preloaded)
        except BaseException:
            self.close()
            raise

    def _restore(self, preloaded: Snapshot | None) -> bool:
        loaded = saved.load(
            self.state_dir, self.store.url, self.config, self.given, self.placement, self.name, snap=preloaded
        )
        if loaded is None:
            return False
        snap, self.config = loaded
        self.model.configure(self.config)
        self.model.restore(snap.params, snap.extra, snap.buffers, snap.layout_digest, snap.aliases)
        self.model.card = snap.model_card
        self.writer.restored()
        self.ledger.round, self.ledger.history = snap.round, [RoundRecord.from_json(h) for h in snap.history]
        self.ledger.opened_at = self.clock()
        self.membership.restore(snap.islands, snap.departed)
        self.downlink.restore(self.round)
        self.accumulator.reset(*self.model.sums())
        self.accumulator.size_budget(self.model.specs, self.name)
        self.downlink.size_budget(self.model.specs)
        log.info("%srestored run %s at round %d from %s", self.name, self.config.run_id, self.round, self.state_dir)
        return True

    def close(self) -> None:
        """Wait for the background checkpoint being written (the server is stopping); let go of the dir."""
        self.writer.close()
        self.model.workers.close()
        if self._dir_lock is not None:
            self._dir_lock.release()
            self._dir_lock = None

    # ---- membership ------------------------------------------------------------------------------
    async def before_join(self, req: JoinRequest) -> None:
        if self.upstream is not None:
            await self.upstream.before_join(req)

    def join(self, req: JoinRequest) -> Admission:
        return self.islands.join(req, self.upstream.chain if self.upstream is not None else ())

    def heartbeat(self, call: IslandCall) -> tuple[int, float, bool]:
        """(open round, lease seconds, run complete)."""
        return self.islands.heartbeat(call)

    def leave(self, call: IslandCall) -> None:
        self.islands.leave(call)

    def evict(self, island_id: str) -> None:
        """Remove an island for good (operator): it no longer counts, its joins are refused."""
        self.islands.evict(island_id)

    def set_operational(self, values: dict) -> list[str]:
        """Change operational fields of the live run (operator); returns what changed. Persisted
        with the next snapshot."""
        self.config, changes = apply_operational(self.config, values)
        for line in changes:
            log.warning("%srun %s changed by an operator: %s", self.name, self.config.run_id, line)
        self.ledger.poke.set()
        return changes

    # ---- pushes and pulls ------------------------------------------------------------------------
    async def plan_push(self, h: PushHeader) -> PushPlan | PushResult:
        await self._past_seal(h.kind is PushKind.INIT, h.round, time.monotonic() + SEAL_WAIT_SECONDS)
        self.pulls.release_if_held()  # the update was written meanwhile: the pushes may have its room
        return self.pushes.plan(h)

    def open_stream(self, plan: PushPlan) -> Reservation:
        return self.accumulator.open_stream(plan.island_id, plan.rank, plan.num_bytes)

    def close_stream(self, plan: PushPlan) -> None:
        self.accumulator.close_stream(plan.island_id, plan.rank)

    def check_entry(self, plan: PushPlan, index: int, payload) -> float:
        """Validate one entry of a push as it completes (worker thread; changes nothing); its norm bound."""
        return self.pushes.check_entry(plan, index, payload)

    async def _past_seal(self, init: bool, round_: int, deadline: float) -> None:
        """A delta for a round that is sealed (its outer step computed, its save pending) takes nothing
        now; when the run folds late pushes it waits for the publish and is folded into the next round,
        rather than dropped. A save that keeps failing past ``deadline`` drops it."""
        while not init and self.pushes.waits_for_publish(round_) and (left := deadline - time.monotonic()) > 0:
            await wait_event(self.ledger.round_changed, min(left, 1.0))

    async def commit_push(self, plan: PushPlan, received: Received, reservation: Reservation) -> PushResult:
        """Stage one rank's validated payloads; the island's contribution commits when all its ranks
        are in, and θ_0 is sealed and published. The reservation is released once the payloads are
        consumed or dropped. It runs to its end even when the call is cancelled (see the locking rule)."""
        commit = asyncio.ensure_future(self._commit_push(plan, received, reservation))
        commit.add_done_callback(lambda t: t.cancelled() or t.exception())  # (its caller may be gone)
        return await asyncio.shield(commit)

    async def _commit_push(self, plan: PushPlan, received: Received, reservation: Reservation) -> PushResult:
        deadline = time.monotonic() + SEAL_WAIT_SECONDS
        while True:
            await self._past_seal(plan.init, plan.round, deadline)
            async with self.lock:
                if not plan.init and self.pushes.waits_for_publish(plan.round) and time.monotonic() < deadline:
                    continue  # another round was sealed meanwhile
                staged = StagedRank(plan, received.payloads, reservation, received.magnitude)
                try:
                    if not plan.init:
                        return await self.pushes.commit_delta(staged)
                    got = self.pushes.commit_init(staged)
                except BaseException:
                    release([staged])
                    raise
                if isinstance(got, PushResult):
                    return got
                params, specs, buffers, layout, aliases = got
                self.model.define(specs, buffers, layout, aliases)
                self.ledger.seal(Sealed(BOOTSTRAP, params, None, None, frozenset({plan.island_id})))
                self.membership.holds(plan.island_id, 0)  # it uploaded θ_0: it has it, no pull of it back
                log.info("%sbootstrapped θ_0 from island %s (%d tensors)", self.name, plan.island_id, len(params))
            await self.try_publish()
            return PushResult(PushOutcome.COMMITTED, self.round, committed=True, bytes_received=plan.num_bytes)

    async def pull(self, req: PullRequest) -> PullAnswer:
        return await self.pulls.pull(req)

    # ---- the one seal -> persist -> publish path -------------------------------------------------
    async def close_round(self, reason: str) -> None:
        """Compute the open round's outer step and seal it, then save and publish it."""
        async with self.lock:
            acc = self.accumulator
            committed = acc.committed
            if not committed or self.ledger.sealed is not None:
                return
            await self.pushes.add_held(everything=True)  # those still waiting for one that did not come
            started = time.perf_counter()
            r, c = self.round, self.config
            self.downlink.release_latest()  # its room goes to θ_{r+1}
            await asyncio.to_thread(self.writer.wait)  # the step changes what it may still write
            if c.outer_mode == "decoupled":  # where each fresh push landed: told to its island with the update
                self.membership.arrived(r, phase.arrival_offsets({i: x.at for i, x in committed.items()}))
            sums, robust_grads = acc.take(c.aggregation, c.clip_norm)
            summary, (share, weight) = acc.record(), self.pushes.round_weight()
            sizes = self.model.update_sizes()
            hint = wal.head_hint(
                sizes, lambda: self.membership.to_json()["islands"], [h.to_json() for h in self.history[-1:]]
            )
            with (
                self.ledger.producing_step(r, sizes, summary["loss"]) as made,
                self.writer.streaming(r, made, hint) as made,  # the record is written meanwhile
            ):
                part = 1.0 if share is None else share  # (Delayed Nesterov counts the shares)
                if self.upstream is not None:  # a relay: the step is the upstream's
                    members = [*committed.items(), *((i, x) for (i, _), x in acc.late.items())]
                    total = acc.weight_total()  # its mean's denominator: Σ w_i (the root makes its own share)
                    params, payloads, opens = await asyncio.to_thread(self.upstream.step, r, sums, total, members, made)
                else:
                    params, payloads = await asyncio.to_thread(self.model.step, sums, weight, robust_grads, made, part)
                    opens = r + 1
            if payloads is None:  # a relay's upstream answered with θ itself: the relay takes it, at its round
                self.ledger.seal(Sealed(opens - 1, params, None, None, frozenset(committed)))
            else:
                record = RoundRecord(
                    round=r,
                    **summary,
                    states=self.states(),
                    bytes_out_per_island=sum(len(p) for p in payloads.values()),
                    reason=reason,
                    seconds_open=self.clock() - self.ledger.opened_at,
                    goodput=run_goodput(self.membership.goodput(), self.clock()),  # the run's, so far
                    outer_step_seconds=time.perf_counter() - started,
                    share=share,
                )
                self.ledger.seal(Sealed(r, params, payloads, record, frozenset(committed)))
            acc.advance(opens - (c.max_staleness if c.late_policy == "fold" else 0))
        await self.try_publish()
        if self.upstream is not None:
            await self._follow_upstream()

    async def try_publish(self) -> bool:
        """Make the sealed round (or θ_0) durable and only then publish it; False if the write failed
        (the decider retries with backoff, the round stays unpublished and /healthz says why)."""
        async with self.lock:
            return await self._publish()

    async def _follow_upstream(self) -> None:
        """A relay whose upstream moved on by more than the round it stepped: the upstream's next
        updates, each sealed and published as a round of its own (no contribution of the relay's in
        it), while the open round has none yet; else they wait for the relay's next step."""
        async with self.lock:
            while self.ledger.sealed is None and not self.accumulator.committed and not self.accumulator.late:
                got = await asyncio.to_thread(self.upstream.follow, self.round, self.model.params)
                if got is None:
                    return
                params, payloads, opens = got
                if payloads is None:  # θ itself: taken at its round
                    self.ledger.seal(Sealed(opens - 1, params, None, None, frozenset()))
                else:
                    record = RoundRecord(round=self.round, states=self.states(), reason="the upstream moved on",
                                         bytes_out_per_island=sum(len(p) for p in payloads.values()))  # fmt: skip
                    self.ledger.seal(Sealed(self.round, params, payloads, record, frozenset()))
                if not await self._publish():
                    return

    async def _publish(self) -> bool:
        """:meth:`try_publish`'s body (the lock held)."""
        sealed = self.ledger.sealed
        if sealed is None:
            return True
        started = time.perf_counter()
        try:
            await asyncio.to_thread(self._durable_write(sealed))
        except Exception as err:  # a full disk, a read-only or vanished dir: retried until it works
            self.ledger.save_failed()  # tentative streams of the round end (NOT_DURABLE)
            what = "θ_0" if sealed.round == BOOTSTRAP else f"round {sealed.round}"
            self.problem = f"saving {what} failed ({err}); it stays unpublished and is retried"
            if sealed.failures == 1 or sealed.failures % 20 == 0:
                log.error("%s%s (attempt %d)", self.name, self.problem, sealed.failures)
            sealed.retry_in = min(sealed.retry_in * 2, SAVE_RETRY_SECONDS[1])
            return False
        if self.problem is not None:
            log.warning("%ssaving works again after %d failed attempts", self.name, sealed.failures)
            self.problem = None
        published = time.perf_counter()
        old = self.model.install(sealed.params)
        if sealed.payloads is not None:
            self.downlink.publish(sealed.round + 1, sealed.payloads)
        self.accumulator.reset(*await asyncio.to_thread(self.model.sums, old))  # the replaced θ, not zeroed
        del old
        if sealed.record is None:  # θ_0 (or a relay's θ from upstream): sized from it, not from a join
            self.accumulator.size_budget(self.model.specs, self.name)
            self.downlink.size_budget(self.model.specs)
        self.ledger.advance(sealed, self.clock())
        self.waiting = ""  # the decider says what the new round waits for
        if self.run_complete:
            self.stall = None
        record = sealed.record
        if record is not None:
            record.persist_seconds = published - started
            loss = "n/a" if record.loss is None else f"{record.loss:.4f}"
            log.info("%sclosed round %d (%s): loss %s, outer step %.3fs + log %.3fs", self.name, sealed.round,
                     record.reason, loss, record.outer_step_seconds, record.persist_seconds)  # fmt: skip
            record.publish_seconds = time.perf_counter() - published
            snap = saved.snapshot(self.owners, self.placement, self.model.params, self.round, list(self.history))
            self.writer.after_publish(snap, keep_from=self.downlink.keep_from(self.round) - 1)
        if self.run_complete:  # the run ending as configured: news, not a warning
            log.info("%srun %s is complete after %d rounds", self.name, self.config.run_id, self.round)
        return True

    def _durable_write(self, sealed: Sealed) -> Callable[[], None]:
        """The write that makes ``sealed`` durable, for a worker thread (what it writes is read here):
        θ_0's snapshot, or a round's log record (update, history record, membership, config)."""
        if sealed.record is None:
            snap = saved.snapshot(self.owners, self.placement, sealed.params, sealed.round + 1, self.history)
            if self.upstream is not None:  # a relay holding the upstream's claim sends θ_0 up first
                up = self.upstream

                def write() -> None:
                    up.send_theta0(sealed.params)
                    self.writer.bootstrap(snap)

                return write
            return lambda: self.writer.bootstrap(snap)
        r, islands, config = sealed.round, self.membership.to_json()["islands"], self.config
        stored = sealed.record.to_json()
        optimizer = self.model.state_tensors() if self.writer.exact else None  # the step's, θ_{r+1}'s
        return lambda: self.writer.log_round(r, sealed.payloads, stored, islands, config, optimizer)
