"""The coordinator's run: sequences membership, staging, the outer step, persistence and the downlink.

Transport-independent (no protobuf, no gRPC): requests and answers are :mod:`messages`, refusals
:class:`~atoll.coordinator.errors.RequestError`. All mutation happens on the event loop under one
lock; heavy tensor work runs in a worker thread while the lock is held. Pushes are checked here
(:mod:`checks`); the background decider that closes rounds and retries a failed save is in
:mod:`closing`.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable
from pathlib import Path

import torch

from atoll.compression import get_codec
from atoll.coordinator import checks, persistence, pushes, robust
from atoll.coordinator.config import ConfigMismatch, RunConfig, apply_operational, reconcile
from atoll.coordinator.downlink import Downlink
from atoll.coordinator.errors import Reason, refuse
from atoll.coordinator.membership import Membership, island_state
from atoll.coordinator.messages import (
    IslandCall,
    JoinAnswer,
    JoinRequest,
    PullAnswer,
    PullRequest,
    PushHeader,
    PushResult,
    UpdateKind,
)
from atoll.coordinator.outer import NesterovSGD, outer_step_
from atoll.coordinator.rounds import RoundPolicy
from atoll.coordinator.staging import (
    InflightBudget,
    PushPlan,
    Reservation,
    Staging,
)
from atoll.sharding import PARTITIONS

log = logging.getLogger("atoll.coordinator")

MIN_INFLIGHT_BYTES = 256 << 20


async def wait_event(event: asyncio.Event, timeout: float) -> bool:
    """Wait up to ``timeout`` seconds for ``event``; returns whether it is set.

    Not ``asyncio.wait_for``: before Python 3.12 it swallows a cancellation of the caller that
    lands in the same loop iteration as the event (python/cpython#86296): the decider then never
    stops, and the server's stop waits on it forever.
    """
    waiter = asyncio.ensure_future(event.wait())
    try:
        await asyncio.wait({waiter}, timeout=timeout)
    finally:
        waiter.cancel()
    return event.is_set()


class RunState:
    def __init__(
        self,
        config: RunConfig,
        state_dir: Path,
        *,
        clock: Callable[[], float] = time.monotonic,
        shard: tuple[int, int] = (0, 1),
        partition: str = "hash",
        keep_snapshots: int = 2,
        max_inflight_bytes: int = 0,
        given: frozenset[str] | None = None,
        name: str = "",
    ) -> None:
        """``shard``: (index, count) of this coordinator; ``partition``: "hash" or "layers" (see
        :mod:`atoll.sharding`). ``max_inflight_bytes``: push bytes held at once (0: twice the model's
        fp32 size, at least 256 MiB). ``given``: the config fields the operator set (None: all); on a
        restart the stored run's math must match them and its operational fields take them."""
        if partition not in PARTITIONS:
            raise ValueError(f"partition must be one of {PARTITIONS}, got {partition!r}")
        if keep_snapshots < 1:
            raise ValueError(f"keep_snapshots must be >= 1, got {keep_snapshots}")
        self.shard, self.partition, self.keep_snapshots = shard, partition, keep_snapshots
        self.state_dir = Path(state_dir)
        self.clock = clock
        self.config = config
        self.given = given
        self.name = name
        """Prefix of this coordinator's log lines ("fragment 1/4: "), empty when it is the only one."""
        self.membership = Membership(clock, lambda: self.config.lease_seconds)
        self.staging = Staging()
        self.downlink = Downlink(self.state_dir)
        self.budget = InflightBudget(max_inflight_bytes or MIN_INFLIGHT_BYTES)
        self._budget_from_model = not max_inflight_bytes
        self.streams: set[tuple[str, int]] = set()
        """(island, rank) of the push streams open now."""
        self.round = 0
        self.params: dict[str, torch.Tensor] | None = None
        self.specs: dict[str, tuple[int, ...]] = {}
        self.buffers: frozenset[str] = frozenset()
        self.layout_digest: str | None = None
        self.optimizer: NesterovSGD | None = None
        self.accum: dict[str, torch.Tensor] = {}
        self.downlink_ef: dict[str, torch.Tensor] = {}
        self.history: list[dict] = []
        self.opened_at = clock()
        self.sealed = None
        """The closed round's outer step while it waits to be saved (see :mod:`closing`)."""
        self.problem: str | None = None
        """Why the coordinator is unhealthy (a save failing), None when it is well."""
        self.stall: str | None = None
        """Why the open round cannot close, with what would unblock it; None when it can."""
        self.waiting = ""
        self.lock = asyncio.Lock()
        self.round_changed = asyncio.Event()
        self.poke = asyncio.Event()
        self.uplink = get_codec(config.codec)
        self.downlink_codec = get_codec(config.downlink_codec)
        self._downlink_state: dict[str, dict] = {}

    # ---- lifecycle -------------------------------------------------------------------------
    def restore(self) -> bool:
        """Load the newest verified snapshot; True if there was one. StateError / ConfigMismatch
        (one line each) when the state dir cannot be trusted or does not fit the asked config."""
        snap = persistence.load(self.state_dir)
        if snap is None:
            return False
        if (snap.shard, snap.partition) != (self.shard, self.partition):
            raise ConfigMismatch(
                f"the state dir belongs to shard {snap.shard[0]}/{snap.shard[1]} ({snap.partition}), not "
                f"{self.shard[0]}/{self.shard[1]} ({self.partition})"
            )
        given = frozenset(f.name for f in RunConfig.__dataclass_fields__.values()) if self.given is None else self.given
        self.config, changes = reconcile(snap.config, self.config, given)
        for line in changes:
            log.warning("%srestored run %s: %s (from the command line)", self.name, self.config.run_id, line)
        self.uplink, self.downlink_codec = get_codec(self.config.codec), get_codec(self.config.downlink_codec)
        self.round, self.params, self.history = snap.round, snap.params, snap.history
        self.specs = {k: tuple(v.shape) for k, v in snap.params.items()}
        self.buffers = frozenset(snap.buffers)
        self.layout_digest = snap.layout_digest or None
        self._init_optimizer()
        self.optimizer.load_state_tensors(snap.extra)
        for name in self.downlink_ef:
            self.downlink_ef[name] = snap.extra[f"downlink_ef/{name}"]
        self.membership.restore(snap.islands, snap.departed)
        self.downlink.restore(self.round)
        self.opened_at = self.clock()
        self._reset_accum()
        self._size_budget()
        log.info("%srestored run %s at round %d from %s", self.name, self.config.run_id, self.round, self.state_dir)
        return True

    def _init_optimizer(self) -> None:
        c = self.config
        shapes = {k: s for k, s in self.specs.items() if k not in self.buffers}
        self.optimizer = NesterovSGD(shapes, lr=c.outer_lr, momentum=c.outer_momentum, nesterov=c.nesterov)
        lossy = self.downlink_codec.lossy
        self.downlink_ef = {k: torch.zeros(s) for k, s in self.specs.items()} if lossy else {}

    def _reset_accum(self) -> None:
        self.accum = {k: torch.zeros(s, dtype=torch.float32) for k, s in self.specs.items()}

    def _size_budget(self, specs: dict[str, tuple[int, ...]] | None = None) -> None:
        """The default in-flight budget: twice the model's fp32 size (at least 256 MiB). Sized from a
        joining island's declared model before θ_0 exists, so θ_0's own upload fits."""
        model_bytes = 4 * sum(math.prod(s) for s in (specs or self.specs).values())
        if self._budget_from_model:
            self.budget.limit = max(self.budget.limit, MIN_INFLIGHT_BYTES, 2 * model_bytes)
        elif model_bytes > self.budget.limit:
            log.error(
                "%s--max-inflight-bytes %d is below one fp32 push of this model (%d bytes): such pushes can never "
                "complete; raise it (compressed pushes are smaller)",
                self.name,
                self.budget.limit,
                model_bytes,
            )

    def snapshot(self, params, round_: int, history: list[dict]) -> persistence.Snapshot:
        extra = dict(self.optimizer.state_tensors())
        extra.update({f"downlink_ef/{k}": v for k, v in self.downlink_ef.items()})
        members = self.membership.to_json()
        return persistence.Snapshot(
            self.config,
            round_,
            params,
            extra,
            members["islands"],
            history,
            members["departed"],
            tuple(sorted(self.buffers)),
            self.shard,
            self.partition,
            self.layout_digest or "",
        )

    @property
    def run_complete(self) -> bool:
        return bool(self.config.total_rounds) and self.round >= self.config.total_rounds

    def policy(self) -> RoundPolicy:
        return RoundPolicy(quorum=self.config.quorum, deadline_seconds=self.config.round_deadline_seconds)

    # ---- membership RPCs -------------------------------------------------------------------
    def join(self, req: JoinRequest) -> JoinAnswer:
        checks.run_id(self.config, req.run_id)
        num_ranks = checks.join(req, self.shard, self.partition, self.config)
        specs = checks.tensors(req.tensors)
        if self.params is not None:
            if self.partition == "layers" and req.layout_digest != self.layout_digest:
                raise refuse(
                    Reason.MODEL_MISMATCH,
                    f"island's model layout {req.layout_digest} differs from the run's {self.layout_digest}: "
                    "islands would cut different fragments",
                )
            checks.same_model(self.specs, specs, self.buffers, checks.buffers_of(req.tensors))
        was_departed = req.island_id in self.membership.departed
        rec, new = self.membership.join(
            req.island_id,
            num_ranks=num_ranks,
            session_id=req.session_id,
            round_=self.round,
            tensors=req.tensors,
            layout_digest=req.layout_digest,
        )
        if new:
            self.staging.drop_island(req.island_id)
        if self.params is None:
            self._size_budget(specs)
        if was_departed:
            self._write_departed()
        bootstrap = self.params is None and self.membership.claim_bootstrap(req.island_id)
        log.info(
            "%sisland %s joined (%d ranks) at round %d%s",
            self.name,
            req.island_id,
            num_ranks,
            self.round,
            ", bootstrapping θ" if bootstrap else "",
        )
        self.poke.set()
        return JoinAnswer(
            config=self.config,
            round=self.round,
            bootstrap=bootstrap,
            codec=self.config.codec,
            run_complete=self.run_complete,
        )

    def heartbeat(self, call: IslandCall) -> tuple[int, float, bool]:
        """(open round, lease seconds, run complete)."""
        checks.run_id(self.config, call.run_id)
        self.membership.touch(call.island_id, call.session_id)
        return self.round, self.config.lease_seconds, self.run_complete

    def leave(self, call: IslandCall) -> None:
        checks.run_id(self.config, call.run_id)
        self.membership.touch(call.island_id, call.session_id)
        self.membership.leave(call.island_id)
        self.staging.drop_island(call.island_id)
        self._write_departed()
        log.info("%sisland %s left at round %d", self.name, call.island_id, self.round)
        self.poke.set()

    def evict(self, island_id: str) -> None:
        """Remove an island for good (operator): it no longer counts, its joins are refused."""
        self.membership.evict(island_id)  # KeyError for an unknown island
        self.staging.drop_island(island_id)
        self._write_departed()
        log.warning("%sisland %s evicted by an operator at round %d", self.name, island_id, self.round)
        self.poke.set()

    def set_operational(self, values: dict) -> list[str]:
        """Change operational fields of the live run (operator); returns what changed. Persisted
        with the next snapshot."""
        self.config, changes = apply_operational(self.config, values)
        for line in changes:
            log.warning("%srun %s changed by an operator: %s", self.name, self.config.run_id, line)
        self.poke.set()
        return changes

    def _write_departed(self) -> None:
        if self.params is not None:  # before θ_0 there is no run to protect
            persistence.write_departed(self.state_dir, self.membership.departed)

    # ---- pushes (atoll.coordinator.pushes) --------------------------------------------------
    def plan_push(self, h: PushHeader) -> PushPlan | PushResult:
        return pushes.plan(self, h)

    async def commit_push(self, plan: PushPlan, payloads: list, reservation: Reservation) -> PushResult:
        return await pushes.commit(self, plan, payloads, reservation)

    # ---- the outer step --------------------------------------------------------------------
    def outer_step(self, weight_total: float) -> tuple[dict[str, torch.Tensor], dict[str, bytearray]]:
        """θ_{r+1} and the encoded update, from the accumulator (which becomes θ_{r+1}); see
        :func:`atoll.coordinator.outer.outer_step_`."""
        robust_grads = None
        if self.config.aggregation != "mean":
            robust_grads = robust.aggregate(
                self.config.aggregation, list(self.staging.dense.values()), clip_norm=self.config.clip_norm
            )
        payloads = outer_step_(
            self.accum,
            self.params,
            weight_total=weight_total,
            optimizer=self.optimizer,
            buffers=self.buffers,
            downlink=self.downlink_codec,
            downlink_ef=self.downlink_ef,
            downlink_state=self._downlink_state,
            robust_grads=robust_grads,
        )
        params, self.accum = self.accum, {}
        return params, payloads

    def publish(self) -> None:
        self.round_changed.set()
        self.round_changed = asyncio.Event()
        self.poke.set()

    # ---- pulls -----------------------------------------------------------------------------
    async def pull(self, req: PullRequest) -> PullAnswer:
        checks.run_id(self.config, req.run_id)
        rec = self.membership.touch(req.island_id, req.session_id)
        wait = min(max(req.wait_seconds, 0.0), 60.0) if math.isfinite(req.wait_seconds) else 0.0
        if self.params is None:
            if rec.tensors and self.membership.claim_bootstrap(req.island_id):
                return PullAnswer(UpdateKind.NOT_READY, self.round, self.round, bootstrap=True)
            await wait_event(self.round_changed, wait)
            self.membership.touch(req.island_id, req.session_id)
            if self.params is None:
                holder = self.membership.bootstrapper or "the first island to join"
                return PullAnswer(UpdateKind.NOT_READY, 0, 0, waiting=f"waiting for θ_0 from {holder}")
        if rec.tensors:
            checks.same_model(self.specs, checks.tensors(rec.tensors), self.buffers, checks.buffers_of(rec.tensors))
        regions = checks.regions(req.regions, self.specs)
        if req.have_round == self.round and not self.run_complete:
            await wait_event(self.round_changed, wait)
            self.membership.touch(req.island_id, req.session_id)
        round_, params = self.round, self.params
        latest = dict(latest_round=round_, run_complete=self.run_complete)
        if req.have_round == round_:
            committed = req.island_id in self.staging.committed or (
                self.sealed is not None and req.island_id in self.sealed.islands
            )
            return PullAnswer(UpdateKind.NOT_READY, round_, committed=committed, waiting=self.waiting, **latest)
        if self.downlink.can_catch_up(req.have_round, round_):
            nxt = req.have_round + 1  # one round at a time; a lagging island pulls again until latest
            entries = self.downlink.delta_entries(nxt, regions, self.specs)
            self._holds(req.island_id, nxt)
            self.release_pulled_update()
            loss = self.history[nxt - 1]["loss"] if len(self.history) >= nxt else None
            return PullAnswer(
                UpdateKind.DELTA, nxt, codec=self.config.downlink_codec, entries=entries, loss=loss, **latest
            )
        loss = self.history[-1]["loss"] if self.history else None
        self._holds(req.island_id, round_)
        return PullAnswer(UpdateKind.FULL, round_, entries=Downlink.full_entries(params, regions), loss=loss, **latest)

    def release_pulled_update(self) -> None:
        """Once every live island holds the latest θ, its update is served from the state dir (to
        islands coming back) and the memory is free for the next round's pushes."""
        if all(r.holds_round >= self.round for r in self.membership.live()):
            self.downlink.release_latest(wait=False)

    def _holds(self, island_id: str, round_: int) -> None:
        rec = self.membership.islands.get(island_id)
        if rec is not None:
            rec.holds_round = max(rec.holds_round, round_)

    # ---- status ----------------------------------------------------------------------------
    def states(self) -> dict[str, str]:
        """Every island's state (joining / active / late / gone / left / evicted)."""
        now = self.clock()
        out = {i: island_state(rec, now, self.round) for i, rec in self.membership.islands.items()}
        out.update({i: how for i, how in self.membership.departed.items() if i not in out})
        return dict(sorted(out.items()))
