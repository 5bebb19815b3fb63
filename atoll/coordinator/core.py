"""The coordinator's run state: membership, staged and committed pushes, the outer step.

Transport-independent: the gRPC servicer (``service.py``) is a thin shell that turns
:class:`RequestError` into a gRPC status. All mutation happens on the event loop under one
lock; heavy tensor work runs in a worker thread while the lock is held.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import torch

from atoll.compression import WireFormatError, available_codecs, codec_name, get_codec
from atoll.coordinator import persistence, robust
from atoll.coordinator.config import RunConfig
from atoll.coordinator.outer import NesterovSGD
from atoll.coordinator.regions import Region, check_coverage
from atoll.coordinator.rounds import Decision, IslandView, RoundPolicy, RoundView, decide, next_wakeup
from atoll.protos import coordinator_pb2 as pb
from atoll.protos.dtypes import TORCH_FROM_PB
from atoll.sharding import PARTITIONS, shard_of

log = logging.getLogger("atoll.coordinator")


async def wait_event(event: asyncio.Event, timeout: float) -> bool:
    """Wait up to ``timeout`` seconds for ``event``; returns whether it is set.

    Not ``asyncio.wait_for``: before Python 3.12 it swallows a cancellation of the caller that
    lands in the same loop iteration as the event (python/cpython#86296): the decider then never
    stops, and the server's stop waits on it forever. That is the likely cause of a stop that hung
    in a CI run right after an island's Leave had set the decider's event.
    """
    waiter = asyncio.ensure_future(event.wait())
    try:
        await asyncio.wait({waiter}, timeout=timeout)
    finally:
        waiter.cancel()
    return event.is_set()


MAX_ID_LEN = 128
MAX_RANKS = 65536
INIT_ROUND = -1
"""The "round" under which a bootstrap island's INIT shards are staged."""
UPDATES_KEPT = 8
"""Outer updates kept in memory: an island up to this many rounds behind catches up by deltas."""


class RequestError(Exception):
    """A request the coordinator refuses; carries the gRPC status code and a reason."""

    def __init__(self, code: grpc.StatusCode, reason: str) -> None:
        super().__init__(reason)
        self.code = code
        self.reason = reason


def _invalid(reason: str) -> RequestError:
    return RequestError(grpc.StatusCode.INVALID_ARGUMENT, reason)


def _precondition(reason: str) -> RequestError:
    return RequestError(grpc.StatusCode.FAILED_PRECONDITION, reason)


@dataclass
class IslandRecord:
    island_id: str
    num_ranks: int
    lease_expires_at: float
    joined_round: int
    rounds_committed: int = 0
    holds_round: int = -1
    """The newest θ version this island pulled (-1: none yet)."""
    last_committed_round: int = -1


class IslandState:
    JOINING = "joining"
    """Joined, has not received θ yet."""
    ACTIVE = "active"
    """Holds the current θ (or the one before it) and took part in the last closed round."""
    LATE = "late"
    """Alive (lease current) but missed the last closed round: a straggler or catching up."""
    GONE = "gone"
    """Lease expired: not waited for; re-joins by itself when it comes back."""


def island_state(rec: IslandRecord, now: float, open_round: int) -> str:
    if rec.lease_expires_at <= now:
        return IslandState.GONE
    if rec.holds_round < 0 and rec.last_committed_round < 0:
        return IslandState.JOINING
    if open_round == 0 or rec.last_committed_round >= open_round - 1:
        return IslandState.ACTIVE
    return IslandState.LATE


@dataclass(frozen=True)
class EntryPlan:
    name: str
    region: Region
    num_bytes: int


@dataclass(frozen=True)
class PushPlan:
    """A validated push header: what the data stream must contain."""

    island_id: str
    round: int
    kind: int
    rank: int
    num_ranks: int
    tokens: int
    loss: float | None
    codec_name: str
    entries: tuple[EntryPlan, ...]


@dataclass
class StagedRank:
    plan: PushPlan
    payloads: list[bytes]
    """Validated, still-encoded payloads, one per entry."""
    num_bytes: int


@dataclass
class Committed:
    tokens: int
    loss: float | None
    num_bytes: int
    weight: float
    """Weight of the delta in the round's average: tokens, times staleness_weight^k if k rounds late."""


@dataclass
class Update:
    """The outer update of one round, as served to islands."""

    payloads: dict[str, bytes] = field(default_factory=dict)
    """Downlink-encoded update per whole tensor."""
    values: dict[str, torch.Tensor] = field(default_factory=dict)
    """The same update decoded: regions of it are served exactly (identity-encoded slices)."""


@dataclass
class PullAnswer:
    kind: int
    round: int
    codec: str = "identity"
    payloads: list[tuple[str, Region | None, bytes]] = field(default_factory=list)
    """(tensor, region or None for the whole tensor, self-describing payload)."""
    committed: bool = False
    loss: float | None = None


class RunState:
    def __init__(
        self,
        config: RunConfig,
        state_dir: Path,
        *,
        clock: Callable[[], float] = time.monotonic,
        shard: tuple[int, int] = (0, 1),
        partition: str = "hash",
    ) -> None:
        """``shard``: (index, count) of this coordinator. ``partition``: which tensors it owns: "hash"
        (``shard_of(name, count) == index``) or "layers" (a contiguous fragment the islands compute from
        the whole model, ``atoll.sharding.layer_partition``; every island must send the same layout)."""
        if partition not in PARTITIONS:
            raise ValueError(f"partition must be one of {PARTITIONS}, got {partition!r}")
        self.shard = shard
        self.partition = partition
        self.layout_digest: str | None = None
        """partition "layers": the model layout the first island joined with (all must match it)."""
        self.state_dir = Path(state_dir)
        self.clock = clock
        self.config = config
        self.round = 0
        self.params: dict[str, torch.Tensor] | None = None
        self.specs: dict[str, tuple[int, ...]] = {}
        self.islands: dict[str, IslandRecord] = {}
        self.history: list[dict] = []
        self.optimizer: NesterovSGD | None = None
        self.downlink_ef: dict[str, torch.Tensor] = {}
        self.opened_at = clock()
        self.bootstrapper: str | None = None
        self.pending: dict[tuple[str, int], dict[int, StagedRank]] = {}
        """Ranks staged so far, by (island, round the push is for)."""
        self.committed: dict[str, Committed] = {}
        """Islands whose contribution to the open round is complete."""
        self.late: dict[tuple[str, int], Committed] = {}
        """Late contributions (island, their round) folded into the open round's accumulator."""
        self.dense: dict[tuple[str, int], tuple[float, dict[str, torch.Tensor]]] = {}
        """Robust aggregation: each contribution's (weight, dense delta) for the open round."""
        self.folded: set[tuple[str, int]] = set()
        """Every (island, round) folded so far (recent rounds): a late delta is applied once."""
        self.accum: dict[str, torch.Tensor] = {}
        self.updates: dict[int, Update] = {}
        self._full_cache: tuple[int, dict[str, bytes]] | None = None
        self.counters = dict.fromkeys(
            ("bytes_in", "bytes_out", "pushes_late_folded", "pushes_late_dropped", "pushes_refused"), 0
        )
        self.lock = asyncio.Lock()
        self.round_changed = asyncio.Event()
        self.poke = asyncio.Event()
        self.uplink = get_codec(config.codec)
        self.downlink = get_codec(config.downlink_codec)
        self._downlink_state: dict[str, dict] = {}

    # ---- lifecycle -------------------------------------------------------------------------
    def restore(self) -> bool:
        """Load the last persisted round from ``state_dir``; True if there was one."""
        snap = persistence.load(self.state_dir)
        if snap is None:
            return False
        if snap.config != self.config:
            log.warning("state dir holds run config %s; it takes precedence over %s", snap.config, self.config)
        self.config = snap.config
        self.uplink = get_codec(self.config.codec)
        self.downlink = get_codec(self.config.downlink_codec)
        self.round = snap.round
        self.params = snap.params
        self.specs = {k: tuple(v.shape) for k, v in snap.params.items()}
        self._init_optimizer()
        self.optimizer.load_state_tensors(snap.extra)
        for name in self.downlink_ef:
            self.downlink_ef[name] = snap.extra[f"downlink_ef/{name}"]
        now = self.clock()
        for island_id, rec in snap.islands.items():
            self.islands[island_id] = IslandRecord(
                island_id,
                rec["num_ranks"],
                now + self.config.lease_seconds,
                rec["joined_round"],
                rec["rounds_committed"],
            )
        self.history = snap.history
        self.opened_at = now
        self._reset_accum()
        log.info("restored run %s at round %d from %s", self.config.run_id, self.round, self.state_dir)
        return True

    def _init_optimizer(self) -> None:
        c = self.config
        self.optimizer = NesterovSGD(self.specs, lr=c.outer_lr, momentum=c.outer_momentum, nesterov=c.nesterov)
        self.downlink_ef = (
            {k: torch.zeros(s, dtype=torch.float32) for k, s in self.specs.items()} if self.downlink.lossy else {}
        )

    def _reset_accum(self) -> None:
        self.accum = {k: torch.zeros(s, dtype=torch.float32) for k, s in self.specs.items()}

    def _snapshot(self, params: dict[str, torch.Tensor], round_: int, history: list[dict]) -> persistence.Snapshot:
        extra = dict(self.optimizer.state_tensors())
        extra.update({f"downlink_ef/{k}": v for k, v in self.downlink_ef.items()})
        islands = {
            i.island_id: {
                "num_ranks": i.num_ranks,
                "joined_round": i.joined_round,
                "rounds_committed": i.rounds_committed,
            }
            for i in self.islands.values()
        }
        return persistence.Snapshot(self.config, round_, params, extra, islands, history)

    # ---- checks ----------------------------------------------------------------------------
    def _check_run(self, run_id: str) -> None:
        if run_id != self.config.run_id:
            raise _precondition(f"run id {run_id!r} does not match this coordinator's run {self.config.run_id!r}")

    def _island(self, island_id: str) -> IslandRecord:
        rec = self.islands.get(island_id)
        if rec is None:
            raise RequestError(
                grpc.StatusCode.NOT_FOUND, f"island {island_id!r} has not joined run {self.config.run_id!r}"
            )
        rec.lease_expires_at = self.clock() + self.config.lease_seconds
        return rec

    # ---- RPCs ------------------------------------------------------------------------------
    def join(self, req: pb.JoinRequest) -> pb.JoinResponse:
        self._check_run(req.run_id)
        if not req.island_id or len(req.island_id) > MAX_ID_LEN:
            raise _invalid(f"island_id must be 1..{MAX_ID_LEN} characters")
        num_ranks = req.num_ranks or 1
        if not 1 <= num_ranks <= MAX_RANKS:
            raise _invalid(f"num_ranks must be in 1..{MAX_RANKS}, got {req.num_ranks}")
        index, count = self.shard
        if (req.shard_index, req.num_shards or 1) != (index, count):
            raise _precondition(
                f"island routes to shard {req.shard_index}/{req.num_shards or 1}; "
                f"this coordinator is shard {index}/{count}"
            )
        if (req.partition or "hash") != self.partition:
            raise _precondition(
                f"island partitions tensors by {req.partition or 'hash'!r}; this coordinator by {self.partition!r}"
            )
        if self.partition == "hash":
            foreign = sorted(t.name for t in req.tensors if shard_of(t.name, count) != index)
            if foreign:
                raise _precondition(f"tensors {foreign[:5]} do not belong to shard {index}/{count}")
        elif not req.layout_digest:
            raise _invalid('partition "layers" needs the layout_digest of the whole model')
        elif self.layout_digest is not None and req.layout_digest != self.layout_digest:
            raise _precondition(
                f"island's model layout {req.layout_digest} differs from the run's {self.layout_digest}: "
                "islands would cut different fragments"
            )
        if codec_name(self.config.codec) not in {codec_name(c) for c in req.codecs}:
            unknown = [c for c in req.codecs if codec_name(c) not in available_codecs()]
            raise _precondition(
                f"run {self.config.run_id!r} uses codec {self.config.codec!r}; the island offers "
                f"{list(req.codecs)}" + (f" (unknown here: {unknown})" if unknown else "")
            )
        specs = {}
        for t in req.tensors:
            if t.name in specs:
                raise _invalid(f"tensor {t.name!r} listed twice")
            if t.dtype not in TORCH_FROM_PB:
                raise _invalid(f"tensor {t.name!r}: unsupported dtype {t.dtype}")
            if any(d < 0 for d in t.shape):
                raise _invalid(f"tensor {t.name!r}: negative dim in shape {list(t.shape)}")
            specs[t.name] = tuple(int(d) for d in t.shape)
        if not specs:
            raise _invalid("the island lists no tensors")
        if self.specs:
            _check_same_model(self.specs, specs)
        if self.partition == "layers" and self.layout_digest is None:
            self.layout_digest = req.layout_digest
        now = self.clock()
        rec = self.islands.get(req.island_id)
        if rec is None or rec.num_ranks != num_ranks:
            rec = IslandRecord(req.island_id, num_ranks, now, self.round)
            self.islands[req.island_id] = rec
            self._drop_pending(req.island_id)
        rec.lease_expires_at = now + self.config.lease_seconds
        bootstrap = False
        if self.params is None:
            holder = self.islands.get(self.bootstrapper) if self.bootstrapper else None
            if holder is None or holder.island_id == req.island_id or holder.lease_expires_at <= now:
                self.bootstrapper = req.island_id
                self.specs = specs
                bootstrap = True
        log.info(
            "island %s joined (%d ranks) at round %d%s",
            req.island_id,
            num_ranks,
            self.round,
            ", bootstrapping θ" if bootstrap else "",
        )
        self.poke.set()
        return pb.JoinResponse(
            config=self.config.to_proto(), round=self.round, bootstrap=bootstrap, codec=self.config.codec
        )

    def heartbeat(self, req: pb.HeartbeatRequest) -> pb.HeartbeatResponse:
        self._check_run(req.run_id)
        self._island(req.island_id)
        return pb.HeartbeatResponse(round=self.round, lease_seconds=self.config.lease_seconds)

    def leave(self, req: pb.LeaveRequest) -> pb.LeaveResponse:
        self._check_run(req.run_id)
        self._island(req.island_id)
        del self.islands[req.island_id]
        self._drop_pending(req.island_id)
        log.info("island %s left at round %d", req.island_id, self.round)
        self.poke.set()
        return pb.LeaveResponse()

    def plan_push(self, h: pb.PushHeader) -> PushPlan | pb.PushResponse:
        """Validate a push header. Returns the plan, or a response for a duplicate push."""
        self._check_run(h.run_id)
        rec = self._island(h.island_id)
        if h.kind == pb.PUSH_KIND_INIT:
            if self.params is not None:
                raise _precondition("the run already has parameters; INIT pushes are only for bootstrap")
            if self.bootstrapper != h.island_id:
                raise _precondition(f"island {h.island_id!r} is not the bootstrap island ({self.bootstrapper!r})")
            if h.codec != "identity":
                raise _invalid("INIT pushes must use the identity codec")
        elif h.kind == pb.PUSH_KIND_DELTA:
            if self.params is None:
                raise RequestError(grpc.StatusCode.UNAVAILABLE, "the run has no parameters yet (bootstrap pending)")
            if codec_name(h.codec) != codec_name(self.config.codec):
                raise _invalid(f"codec {h.codec!r} is not the run's codec {self.config.codec!r}")
            if h.round > self.round:
                raise _precondition(f"round {h.round} is in the future; the coordinator is at round {self.round}")
            if h.round < self.round:
                self._check_late(h.round)
                if (h.island_id, h.round) in self.folded:
                    return pb.PushResponse(committed=True, duplicate=True, round=self.round)
            done = self.committed.get(h.island_id) if h.round == self.round else None
            if done is not None or h.rank in self.pending.get((h.island_id, h.round), {}):
                return pb.PushResponse(committed=done is not None, duplicate=True, round=self.round)
        else:
            raise _invalid(f"unknown push kind {h.kind}")
        if h.num_ranks != rec.num_ranks:
            raise _invalid(f"island {h.island_id!r} joined with {rec.num_ranks} ranks, push says {h.num_ranks}")
        if not 0 <= h.rank < rec.num_ranks:
            raise _invalid(f"rank {h.rank} outside 0..{rec.num_ranks - 1}")
        if h.HasField("loss") and not math.isfinite(h.loss):
            raise _invalid("reported loss is not finite")
        entries = []
        for e in h.entries:
            shape = self.specs.get(e.name)
            if shape is None:
                raise _invalid(f"unknown tensor {e.name!r}")
            try:
                region = Region.parse(e.offsets, e.sizes, shape)
            except ValueError as err:
                raise _invalid(f"tensor {e.name!r}: {err}") from None
            bound = 8 * region.numel + 65536
            if not 0 < e.num_bytes <= bound:
                raise _invalid(f"tensor {e.name!r}: payload of {e.num_bytes} bytes outside 1..{bound}")
            entries.append(EntryPlan(e.name, region, e.num_bytes))
        loss = h.loss if h.HasField("loss") else None
        return PushPlan(h.island_id, h.round, h.kind, h.rank, h.num_ranks, h.tokens, loss, h.codec, tuple(entries))

    def _codec_of(self, plan: PushPlan):
        return self.uplink if plan.kind == pb.PUSH_KIND_DELTA else get_codec("identity")

    def check_entry(self, plan: PushPlan, index: int, payload: bytes) -> bytes:
        """Validate one entry's payload (structure, bounds, finite values) without decoding it densely.

        Runs in a worker thread. The payload is staged as is and decoded into the accumulator only
        when the island's contribution commits.
        """
        entry = plan.entries[index]
        try:
            self._codec_of(plan).validate(payload, entry.region.sizes)
        except WireFormatError as err:
            raise _invalid(f"tensor {entry.name!r}: {err}") from None
        return payload

    async def commit_push(self, plan: PushPlan, payloads: list[bytes], num_bytes: int) -> pb.PushResponse:
        async with self.lock:
            if plan.kind == pb.PUSH_KIND_INIT:
                return await self._commit_init(plan, payloads, num_bytes)
            late = plan.round < self.round
            if late:
                try:
                    self._check_late(plan.round)
                except RequestError:
                    raise _precondition(f"round {plan.round} closed while the push was streaming") from None
            rec = self.islands.get(plan.island_id)
            if rec is None or rec.num_ranks != plan.num_ranks:
                raise _precondition(f"island {plan.island_id!r} left or re-joined while pushing")
            key = (plan.island_id, plan.round)
            done = key in self.folded if late else plan.island_id in self.committed
            if done or plan.rank in self.pending.get(key, {}):
                return pb.PushResponse(committed=done, duplicate=True, round=self.round)
            staged = self.pending.setdefault(key, {})
            staged[plan.rank] = StagedRank(plan, payloads, num_bytes)
            if len(staged) < rec.num_ranks:
                return pb.PushResponse(committed=False, round=self.round, bytes_received=num_bytes)
            del self.pending[key]
            ranks = [staged[r] for r in sorted(staged)]
            try:
                _check_island_coverage(self.specs, ranks)
            except ValueError as err:
                raise _invalid(f"island {plan.island_id!r} discarded for round {self.round}: {err}") from None
            tokens = ranks[0].plan.tokens
            weight = float(max(tokens, 1))
            if late:
                weight *= self.config.staleness_weight ** (self.round - plan.round)
            if self.config.aggregation == "mean" and not self.config.max_delta_norm:
                await asyncio.to_thread(self._accumulate, ranks, weight)
            else:
                await self._stage_dense(key, ranks, weight)
            record = Committed(tokens, ranks[0].plan.loss, sum(r.num_bytes for r in ranks), weight)
            self.counters["bytes_in"] += record.num_bytes
            if late:
                self.late[key] = record
                self.folded.add(key)
                self.counters["pushes_late_folded"] += 1
                log.info(
                    "round %d: folded island %s's late delta for round %d (weight %.3g)",
                    self.round,
                    plan.island_id,
                    plan.round,
                    weight,
                )
            else:
                self.committed[plan.island_id] = record
                rec.rounds_committed += 1
                rec.last_committed_round = plan.round
                log.info("round %d: island %s committed (%d tokens)", self.round, plan.island_id, tokens)
            self.poke.set()
            return pb.PushResponse(committed=True, round=self.round, bytes_received=num_bytes)

    def _check_late(self, push_round: int) -> None:
        """Refuse a push for a closed round unless the run folds it (and it is not too stale)."""
        stale = self.round - push_round
        if self.config.late_policy != "fold" or stale > self.config.max_staleness:
            self.counters["pushes_late_dropped"] += 1
            raise _precondition(
                f"round {push_round} is closed; the coordinator is at round {self.round} (late policy "
                f"{self.config.late_policy!r}, max staleness {self.config.max_staleness})"
            )

    def _drop_pending(self, island_id: str) -> None:
        for key in [k for k in self.pending if k[0] == island_id]:
            del self.pending[key]

    async def _stage_dense(self, key: tuple[str, int], ranks: list[StagedRank], weight: float) -> None:
        """Norm bound and robust aggregation need the island's whole delta: assemble it densely."""
        delta = await asyncio.to_thread(self._assemble, ranks)
        norm = robust.l2_norm(delta)
        bound = self.config.max_delta_norm
        if bound and norm > bound:
            self.counters["pushes_refused"] += 1
            raise _invalid(f"island {key[0]!r} discarded for round {key[1]}: delta norm {norm:.4g} exceeds {bound:g}")
        if self.config.aggregation == "mean":
            for name, t in delta.items():
                self.accum[name].add_(t, alpha=weight)
        else:
            self.dense[key] = (weight, delta)

    def _assemble(self, ranks: list[StagedRank]) -> dict[str, torch.Tensor]:
        out = {k: torch.zeros(s, dtype=torch.float32) for k, s in self.specs.items()}
        for staged in ranks:
            codec = self._codec_of(staged.plan)
            for entry, payload in zip(staged.plan.entries, staged.payloads, strict=True):
                out[entry.name][entry.region.slices()] = codec.decode(payload, entry.region.sizes)
        return out

    def _accumulate(self, ranks: list[StagedRank], weight: float) -> None:
        for staged in ranks:
            codec = self._codec_of(staged.plan)
            for entry, payload in zip(staged.plan.entries, staged.payloads, strict=True):
                target = self.accum[entry.name][entry.region.slices()]
                if target.is_contiguous():
                    codec.decode_add_(payload, target, alpha=weight)
                else:
                    target.add_(codec.decode(payload, entry.region.sizes), alpha=weight)

    async def _commit_init(self, plan: PushPlan, payloads: list[bytes], num_bytes: int) -> pb.PushResponse:
        if self.params is not None:
            return pb.PushResponse(committed=True, duplicate=True, round=self.round)
        key = (plan.island_id, INIT_ROUND)
        staged = self.pending.setdefault(key, {})
        staged[plan.rank] = StagedRank(plan, payloads, num_bytes)
        if len(staged) < plan.num_ranks:
            return pb.PushResponse(committed=False, round=0, bytes_received=num_bytes)
        ranks = [staged[r] for r in sorted(staged)]
        del self.pending[key]
        try:
            _check_island_coverage(self.specs, ranks)
        except ValueError as err:
            raise _invalid(f"bootstrap θ rejected: {err}") from None
        params = {k: torch.zeros(s, dtype=torch.float32) for k, s in self.specs.items()}
        ident = get_codec("identity")
        for staged in ranks:
            for entry, payload in zip(staged.plan.entries, staged.payloads, strict=True):
                params[entry.name][entry.region.slices()] = ident.decode(payload, entry.region.sizes)
        self._init_optimizer()
        await asyncio.to_thread(persistence.save, self.state_dir, self._snapshot(params, 0, []))
        self.params = params
        self.round = 0
        self.opened_at = self.clock()
        self._reset_accum()
        log.info("bootstrapped θ_0 from island %s (%d tensors)", plan.island_id, len(params))
        self._publish()
        return pb.PushResponse(committed=True, round=0, bytes_received=num_bytes)

    # ---- rounds ----------------------------------------------------------------------------
    def view(self) -> RoundView:
        islands = tuple(
            IslandView(
                island_id=i.island_id, lease_expires_at=i.lease_expires_at, committed=i.island_id in self.committed
            )
            for i in self.islands.values()
        )
        extra = tuple(  # committed islands that left since still count
            IslandView(island_id=k, lease_expires_at=0.0, committed=True)
            for k in self.committed
            if k not in self.islands
        )
        return RoundView(round=self.round, opened_at=self.opened_at, islands=islands + extra)

    def policy(self) -> RoundPolicy:
        return RoundPolicy(quorum=self.config.quorum, deadline_seconds=self.config.round_deadline_seconds)

    async def run_decider(self) -> None:
        """Background task: evaluate ``decide`` on every change and at deadlines."""
        last_reason = ""
        while True:
            timeout = 1.0
            if self.params is not None:
                now = self.clock()
                view = self.view()
                decision, reason = decide(now, view, self.policy())
                if decision is Decision.CLOSE:
                    await self.close_round(reason)
                    continue
                if reason != last_reason:
                    log.info("%s", reason)
                    last_reason = reason
                wake = next_wakeup(now, view, self.policy())
                if wake is not None:
                    timeout = min(max(wake - now, 0.005), 1.0)
            await wait_event(self.poke, timeout)
            self.poke.clear()

    async def close_round(self, reason: str) -> None:
        async with self.lock:
            if not self.committed:
                return
            started = time.perf_counter()
            r = self.round
            total = sum(c.tokens for c in self.committed.values())
            losses = [(c.tokens, c.loss) for c in self.committed.values() if c.loss is not None]
            loss = sum(t * v for t, v in losses) / max(sum(t for t, _ in losses), 1) if losses else None
            weight_total = sum(c.weight for c in self.committed.values()) + sum(c.weight for c in self.late.values())
            params, update = await asyncio.to_thread(self._outer_step, weight_total)
            record = {
                "round": r,
                "islands": sorted(self.committed),
                "late": sorted([island, rnd] for island, rnd in self.late),
                "states": self.states(),
                "tokens": total,
                "loss": loss,
                "bytes_in": sum(c.num_bytes for c in self.committed.values()),
                "bytes_out_per_island": sum(len(p) for p in update.payloads.values()),
                "reason": reason,
                "seconds_open": self.clock() - self.opened_at,
            }
            history = [*self.history, record]
            await asyncio.to_thread(persistence.save, self.state_dir, self._snapshot(params, r + 1, history))
            self.params = params
            self.history = history
            self.updates[r + 1] = update
            for old in [k for k in self.updates if k <= r + 1 - UPDATES_KEPT]:
                del self.updates[old]
            self.round = r + 1
            self.opened_at = self.clock()
            self.committed = {}
            self.late = {}
            self.dense = {}
            keep_from = self.round - (self.config.max_staleness if self.config.late_policy == "fold" else 0)
            self.pending = {k: v for k, v in self.pending.items() if k[1] >= keep_from}
            self.folded = {k for k in self.folded if k[1] >= keep_from - 1}
            self._reset_accum()
            log.info(
                "closed round %d (%s): loss %s, outer step + persist %.3fs",
                r,
                reason,
                "n/a" if loss is None else f"{loss:.4f}",
                time.perf_counter() - started,
            )
            self._publish()

    def _outer_step(self, weight_total: float) -> tuple[dict[str, torch.Tensor], Update]:
        """θ_{r+1} = θ_r + decode(encode(u + e)) with u from the token-weighted mean delta.

        The accumulator holds sum(w_i * Δ_i) with w_i = max(tokens_i, 1) (times staleness_weight^k for a
        delta k rounds late); weight_total is sum(w_i).
        """
        if self.config.aggregation == "mean":
            grads = {k: v.div(weight_total) for k, v in self.accum.items()}
        else:
            grads = robust.aggregate(
                self.config.aggregation, list(self.dense.values()), clip_norm=self.config.clip_norm
            )
        update = self.optimizer.update(grads)
        params, out = {}, Update()
        for name, u in update.items():
            if self.downlink.lossy:
                u = u + self.downlink_ef[name]
            payload = self.downlink.encode(u, self._downlink_state.setdefault(name, {}))
            u_hat = self.downlink.decode(payload, self.specs[name])
            if self.downlink.lossy:
                self.downlink_ef[name] = u - u_hat
            params[name] = self.params[name] + u_hat
            out.payloads[name] = payload
            out.values[name] = u_hat
        return params, out

    def _publish(self) -> None:
        self.round_changed.set()
        self.round_changed = asyncio.Event()
        self.poke.set()

    # ---- pulls -----------------------------------------------------------------------------
    async def pull(self, req: pb.PullRequest) -> PullAnswer:
        self._check_run(req.run_id)
        self._island(req.island_id)
        regions = self._parse_regions(req.regions) if self.specs else []
        if req.have_round > self.round:
            raise _precondition(
                f"island holds round {req.have_round}, ahead of the coordinator's {self.round}; "
                "pull the full parameters (have_round=-1)"
            )
        wait = min(max(req.wait_seconds, 0.0), 60.0) if math.isfinite(req.wait_seconds) else 0.0
        if self.params is None or req.have_round == self.round:
            await wait_event(self.round_changed, wait)
            self._island(req.island_id)
        if self.params is None or req.have_round == self.round:
            return PullAnswer(pb.UPDATE_KIND_NOT_READY, self.round, committed=req.island_id in self.committed)
        loss = self.history[-1]["loss"] if self.history else None
        round_, params = self.round, self.params
        if req.have_round >= 0 and all(r in self.updates for r in range(req.have_round + 1, round_ + 1)):
            # One round at a time: θ_{h+1} = θ_h + u_{h+1}; a lagging island pulls again until latest.
            nxt = req.have_round + 1
            update = self.updates[nxt]
            payloads = await asyncio.to_thread(self._region_payloads, regions, update.payloads, update.values)
            loss = self.history[nxt - 1]["loss"] if len(self.history) >= nxt else None
            self._holds(req.island_id, nxt)
            return PullAnswer(pb.UPDATE_KIND_DELTA, nxt, self.config.downlink_codec, payloads, loss=loss)
        full = await self._full_payloads()
        payloads = await asyncio.to_thread(self._region_payloads, regions, full, params)
        self._holds(req.island_id, round_)
        return PullAnswer(pb.UPDATE_KIND_FULL, round_, "identity", payloads, loss=loss)

    def _holds(self, island_id: str, round_: int) -> None:
        rec = self.islands.get(island_id)
        if rec is not None:
            rec.holds_round = max(rec.holds_round, round_)

    def states(self) -> dict[str, str]:
        """Every member's state (joining / active / late / gone), for logs, history and status."""
        now = self.clock()
        return {i: island_state(rec, now, self.round) for i, rec in sorted(self.islands.items())}

    def _parse_regions(self, entries) -> list[tuple[str, Region | None]]:
        if not entries:
            return [(name, None) for name in self.specs]
        if len(entries) > 4 * len(self.specs) + 64:
            raise _invalid(f"{len(entries)} regions requested for a model of {len(self.specs)} tensors")
        out = []
        for e in entries:
            shape = self.specs.get(e.name)
            if shape is None:
                raise _invalid(f"unknown tensor {e.name!r}")
            if not e.offsets and not e.sizes:
                out.append((e.name, None))
                continue
            try:
                out.append((e.name, Region.parse(e.offsets, e.sizes, shape)))
            except ValueError as err:
                raise _invalid(f"tensor {e.name!r}: {err}") from None
        return out

    @staticmethod
    def _region_payloads(regions, whole: dict[str, bytes], values: dict[str, torch.Tensor]):
        """Whole tensors as prepared; a region as an exact (identity) slice of the values."""
        ident = get_codec("identity")
        return [
            (name, region, whole[name] if region is None else ident.encode(values[name][region.slices()].contiguous()))
            for name, region in regions
        ]

    async def _full_payloads(self) -> dict[str, bytes]:
        round_, params = self.round, self.params
        if self._full_cache is None or self._full_cache[0] != round_:
            ident = get_codec("identity")
            payloads = await asyncio.to_thread(lambda: {k: ident.encode(v) for k, v in params.items()})
            self._full_cache = (round_, payloads)
        return self._full_cache[1]


def _check_same_model(have: dict[str, tuple[int, ...]], got: dict[str, tuple[int, ...]]) -> None:
    missing = sorted(have.keys() - got.keys())
    extra = sorted(got.keys() - have.keys())
    if missing or extra:
        raise _precondition(f"model does not match the run: missing tensors {missing[:5]}, unknown tensors {extra[:5]}")
    for name, shape in got.items():
        if have[name] != shape:
            raise _precondition(f"tensor {name!r} has shape {list(shape)}, the run has {list(have[name])}")


def _check_island_coverage(specs: dict[str, tuple[int, ...]], ranks: list[StagedRank]) -> None:
    regions: dict[str, list[Region]] = {name: [] for name in specs}
    for staged in ranks:
        for entry in staged.plan.entries:
            regions[entry.name].append(entry.region)
    for name, shape in specs.items():
        check_coverage(name, shape, regions[name])
