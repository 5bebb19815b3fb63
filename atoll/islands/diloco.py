"""The DiLoCo wrapper an island drops into its training loop.

    sync = DiLoCo(model, inner_opt, coordinator="host:port", sync_every=100, codec="int8")
    sync.start()                     # joins; all islands start from the same θ
    for batch in data:
        loss = ...; loss.backward(); inner_opt.step(); inner_opt.zero_grad()
        sync.step(tokens=batch.numel(), loss=loss.item())   # pushes/pulls every H steps
    sync.close()

Works unchanged on a plain module, an FSDP2 (``fully_shard``) module, a tensor-parallel
(``parallelize_module``) module or a 2-D mesh of both: every rank pushes and pulls only its own
shards (see :mod:`atoll.islands.shards`), so no rank ever builds a full-model Δ. The constructor
does no network I/O; ``start()`` does (and is collective over the island's process group).
"""

from __future__ import annotations

import contextlib
import logging
import math
import threading
import time
import uuid
from dataclasses import dataclass, field

import grpc
import torch
import torch.distributed as dist

from atoll.compression import ErrorFeedback, available_codecs, codec_name, decode_any, get_codec
from atoll.islands.client import ClientTls, CoordinatorClient, RetryPolicy
from atoll.islands.shards import LocalShard, local_shards
from atoll.protos import coordinator_pb2 as pb
from atoll.protos.dtypes import PB_FROM_TORCH
from atoll.sharding import layer_partition, layout_digest, shard_of

log = logging.getLogger("atoll.island")


@dataclass
class RoundStats:
    round: int
    """The round this island just finished (its delta was for this round)."""
    inner_steps: int
    tokens: int
    loss: float | None
    """Mean of the losses passed to ``step`` during the round."""
    global_loss: float | None
    """Token-weighted mean loss over the islands that committed the round (from the coordinator)."""
    bytes_sent: int
    bytes_received: int
    sync_seconds: float
    update_kind: str
    max_payload_numel: int
    """Largest tensor region this rank encoded in the round (no rank encodes a full sharded tensor)."""
    shards: tuple[int, ...] = ()
    """The coordinator shards (streaming: fragments) this exchange synced."""


@dataclass
class _Link:
    """The island's session with one coordinator shard (the whole coordinator when unsharded)."""

    index: int
    address: str
    shards: list[LocalShard]
    """The parameter regions this rank holds whose tensors the shard owns."""
    client: CoordinatorClient | None = None
    round: int = -1
    first_sync: int = 0
    """Streaming: inner steps before this fragment's first sync (staggered); later ones every H."""
    steps: int = 0
    """Inner steps since this link last synced (its current round's steps so far)."""
    tokens: int = 0
    losses: list[float] = field(default_factory=list)
    started: float = 0.0
    pushed: int = 0
    """Rounds this link has pushed since start()."""
    exchange: _Exchange | None = None
    """The push/pull in flight in the background (overlap), if any."""


@dataclass
class _Exchange:
    """One outer exchange (push, wait for the outer step, pull) over one or more links."""

    links: list[_Link]
    round: int
    steps: int
    tokens: int
    loss: float | None
    pushed_at: int
    """``inner_steps`` when it was pushed."""
    snapshot: dict[tuple, torch.Tensor] | None
    """Overlap: θ of this rank's regions at push time, to carry the progress made meanwhile."""
    pushes: list[tuple]
    """(link, header, payloads) per link."""
    bytes0: tuple[int, int]
    blocked: float = 0.0
    """Seconds the training loop spent on this exchange (encoding, waiting, applying)."""
    updates: list[tuple] = field(default_factory=list)
    """(link, header, payloads) of every update pulled, in order."""
    result: tuple[str, float | None] = ("", None)
    max_payload_numel: int = 0
    error: BaseException | None = None
    thread: threading.Thread | None = None


class DiLoCo:
    def __init__(
        self,
        model: torch.nn.Module,
        inner_optimizer: torch.optim.Optimizer,
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
        keep_last_delta: bool = False,
        sync_every_seconds: float | None = None,
        client_factory=None,
        token: str | None = None,
        tls: ClientTls | None = None,
        overlap_steps: int = 0,
        streaming: bool = False,
    ) -> None:
        """``sync_every_seconds``: sync on a time budget instead of every H steps (adaptive inner steps:
        a slow island does fewer steps; its delta is weighted by the tokens it reports).
        ``client_factory(address, retry=..., token=..., tls=...)``: builds the coordinator client (fault
        injection wraps it). ``token``: this island's bearer token; ``tls``: TLS / mutual TLS settings.

        ``overlap_steps`` τ > 0: push and pull in the background and keep training; the outer update
        is applied τ inner steps after the push (waiting only if it has not arrived by then), keeping
        the progress made meanwhile: θ ← θ_global + (θ_now − θ_at_push) (one-step-delayed outer
        update). 0 is plain DiLoCo, exactly. ``streaming``: the coordinator shards are the fragments
        of Streaming DiLoCo (contiguous blocks of layers, balanced by size; start the coordinator with
        ``--fragments P``) and fragment p syncs on its own staggered schedule, first after
        ⌈(p+1)·H/P⌉ steps, then every H, so each sync moves about 1/P of the model."""
        self.client_factory = client_factory or CoordinatorClient
        self.client_kwargs = {"token": token, "tls": tls}
        if codec is not None:
            get_codec(codec)  # ValueError with the reason for a bad spec
        if sync_every is not None and sync_every < 1:
            raise ValueError(f"sync_every must be >= 1, got {sync_every}")
        if sync_every_seconds is not None and not sync_every_seconds > 0:
            raise ValueError(f"sync_every_seconds must be > 0, got {sync_every_seconds}")
        if overlap_steps < 0:
            raise ValueError(f"overlap_steps must be >= 0, got {overlap_steps}")
        if streaming and sync_every_seconds is not None:
            raise ValueError("streaming staggers fragments by inner steps; it cannot sync on a time budget")
        self.sync_every_seconds = sync_every_seconds
        self.overlap_steps = overlap_steps
        self.streaming = streaming
        distributed = dist.is_available() and dist.is_initialized()
        if distributed and island_id is None:
            raise ValueError("a multi-rank island needs an explicit island_id shared by its ranks")
        self.model = model
        self.inner_optimizer = inner_optimizer
        self.addresses = [a.strip() for a in coordinator.split(",") if a.strip()]
        if not self.addresses:
            raise ValueError("coordinator must be host:port, or a comma-separated list of its shards")
        self.links: list[_Link] = []
        self.requested_sync_every = sync_every
        self.codec_name = codec
        self.run_id = run_id
        self.island_id = island_id or f"island-{uuid.uuid4().hex[:8]}"
        self.group = process_group
        self.rank = dist.get_rank(process_group) if distributed else 0
        self.num_ranks = dist.get_world_size(process_group) if distributed else 1
        self.heartbeat_seconds = heartbeat_seconds
        self.pull_wait_seconds = pull_wait_seconds
        self.retry = retry
        self.keep_last_delta = keep_last_delta
        self.last_delta: dict[tuple, torch.Tensor] = {}
        self.shards: list[LocalShard] = []
        self.sync_every = sync_every or 0
        self.inner_steps = 0
        self.history: list[RoundStats] = []
        self.codec = None  # the run's codec, set by start()
        self._start: dict[tuple, torch.Tensor] = {}
        self._codec_state: dict[tuple, dict] = {}
        self._buffers: dict[tuple, bytearray] = {}
        self._layout = ""
        self._hb_stop = threading.Event()
        self._hb_thread: threading.Thread | None = None

    # ---- lifecycle -------------------------------------------------------------------------
    def start(self) -> DiLoCo:
        self.shards = local_shards(self.model, self.group)
        n = len(self.addresses)
        if self.streaming:
            layout = [(name, tuple(p.shape)) for name, p in self.model.named_parameters()]
            fragment = layer_partition([(name, math.prod(shape)) for name, shape in layout], n)
            self._layout = layout_digest(layout)
        else:
            fragment = {s.name: shard_of(s.name, n) for s in self.shards}
        self.links = [
            _Link(i, addr, [s for s in self.shards if fragment[s.name] == i]) for i, addr in enumerate(self.addresses)
        ]
        empty = [link.index for link in self.links if not link.shards]
        if empty:
            raise ValueError(f"coordinator shards {empty} of {n} own none of the model's tensors; use fewer shards")
        bootstrap = []
        for link in self.links:
            link.client = self.client_factory(link.address, retry=self.retry, **self.client_kwargs)
            joined = self._join(link)
            if self.overlap_steps and self.sync_every_seconds is None and self.overlap_steps >= self.sync_every:
                raise ValueError(f"overlap_steps ({self.overlap_steps}) must be below the run's H ({self.sync_every})")
            if joined.bootstrap:
                bootstrap.append(link)
        # Heartbeats from the join on: uploading θ_0 or waiting for another island's can take longer
        # than the lease, and an island whose lease ran out meanwhile is not waited for (a
        # bootstrapper's role even passes to the next island that joins).
        self._hb_thread = threading.Thread(target=self._heartbeats, name="atoll-heartbeat", daemon=True)
        self._hb_thread.start()
        try:
            for link in bootstrap:
                self._bootstrap(link)
            for link in self.links:
                self._pull_until_ready(link, have_round=-1, on_update=self._apply)
                self._set_params(link)
        except BaseException:
            self._stop_heartbeats()  # a failed start must not keep the island alive on the coordinator
            raise
        now = time.monotonic()
        for link in self.links:
            link.started = now
            link.first_sync = -(-(link.index + 1) * self.sync_every // n) if self.streaming else self.sync_every
        return self

    def __enter__(self) -> DiLoCo:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def round(self) -> int:
        """The round this island works on (the oldest over coordinator shards; -1 before start)."""
        return min((link.round for link in self.links), default=-1)

    @property
    def rounds_pushed(self) -> int:
        """Rounds pushed since start() (the fewest over coordinator shards / fragments)."""
        return min((link.pushed for link in self.links), default=0)

    def close(self, leave: bool = True) -> None:
        """Leave the run. An exchange still in flight is abandoned (call ``drain()`` first to wait
        for it and apply it)."""
        self._hb_stop.set()
        for link in self.links:
            if link.exchange is not None:
                log.warning("%s: closing with round %d's exchange in flight; abandoned", self.island_id, link.round)
                link.exchange = None
        self._stop_heartbeats()
        if not any(link.client for link in self.links):
            return
        if self.num_ranks > 1:
            with contextlib.suppress(RuntimeError):  # a peer may already be gone
                dist.barrier(group=self.group)
        for link in self.links:
            if link.client is None:
                continue
            if leave and self.rank == 0:
                try:
                    link.client.leave(pb.LeaveRequest(run_id=self.run_id, island_id=self.island_id))
                except grpc.RpcError as err:
                    log.warning("leave failed on shard %d: %s", link.index, err)
            link.client.close()
            link.client = None

    def _join(self, link: _Link) -> pb.JoinResponse:
        offered = [codec_name(self.codec_name)] if self.codec_name else available_codecs()
        req = pb.JoinRequest(
            run_id=self.run_id,
            island_id=self.island_id,
            codecs=offered,
            num_ranks=self.num_ranks,
            shard_index=link.index,
            num_shards=len(self.links),
            partition="layers" if self.streaming else "hash",
            layout_digest=self._layout,
        )
        seen = set()
        for shard in link.shards:
            if shard.name not in seen:
                seen.add(shard.name)
                req.tensors.add(name=shard.name, shape=list(shard.param.shape), dtype=PB_FROM_TORCH[shard.param.dtype])
        resp = link.client.join(req)
        if self.requested_sync_every is None:
            self.sync_every = resp.config.sync_every
        if self.codec is None or self.codec.spec != get_codec(resp.codec).spec:
            if self.codec is not None and link.index > 0:
                raise RuntimeError(f"coordinator shard {link.index} runs codec {resp.codec}, another {self.codec.spec}")
            codec = get_codec(resp.codec)
            decay = resp.config.error_feedback_decay or 1.0  # 0: unset by an older coordinator
            self.codec = ErrorFeedback(codec, decay) if resp.config.error_feedback and codec.lossy else codec
            self._codec_state = {}
        log.info(
            "%s[%d/%d] joined run %s (shard %d/%d) at round %d (H=%d, codec %s)",
            self.island_id,
            self.rank,
            self.num_ranks,
            self.run_id,
            link.index,
            len(self.links),
            resp.round,
            self.sync_every,
            resp.codec,
        )
        return resp

    def _bootstrap(self, link: _Link) -> None:
        ident = get_codec("identity")
        owned = [s for s in link.shards if s.owned]
        payloads = [ident.encode(s.local().detach()) for s in owned]
        link.client.push(self._header(pb.PUSH_KIND_INIT, 0, owned, payloads, "identity"), payloads)

    def _stop_heartbeats(self) -> None:
        self._hb_stop.set()
        if self._hb_thread is not None:
            self._hb_thread.join(timeout=5)
            self._hb_thread = None

    def _heartbeats(self) -> None:
        while not self._hb_stop.wait(self.heartbeat_seconds):
            for link in self.links:
                try:
                    link.client.heartbeat(
                        pb.HeartbeatRequest(run_id=self.run_id, island_id=self.island_id, round=link.round)
                    )
                except grpc.RpcError as err:
                    if err.code() == grpc.StatusCode.NOT_FOUND:
                        log.info("coordinator shard %d forgot %s; re-joining", link.index, self.island_id)
                        with contextlib.suppress(grpc.RpcError):
                            self._join(link)
                except (ValueError, AttributeError):  # channel closed under us during shutdown
                    return

    # ---- training loop ---------------------------------------------------------------------
    def step(self, tokens: int = 0, loss: float | None = None) -> RoundStats | None:
        """Call after each inner optimizer step. Returns a round's stats when one completed (its
        outer update was applied: at the sync, or ``overlap_steps`` later when overlapping).

        ``tokens``: tokens the whole island processed in this step (the same on every rank).
        """
        if not self.links:
            raise RuntimeError("DiLoCo.start() was not called")
        self.inner_steps += 1
        for link in self.links:
            link.steps += 1
            link.tokens += int(tokens)
            if loss is not None:
                link.losses.append(float(loss))
        done = None
        for link in self.links:
            ex = link.exchange
            if ex is not None and self.inner_steps - ex.pushed_at >= self.overlap_steps:
                done = self._finish(ex)
        due = self._due_links()
        if due:
            ex = self._begin(due)
            if not self.overlap_steps:
                done = self._finish(ex)
        return done

    @property
    def round_steps(self) -> int:
        """Inner steps taken so far in the current round (of the oldest shard / fragment)."""
        return min(self.links, key=lambda link: link.round).steps if self.links else 0

    def _due_links(self) -> list[_Link]:
        if self.sync_every_seconds is None:
            return [
                link
                for link in self.links
                if link.exchange is None and link.steps >= (link.first_sync if link.pushed == 0 else self.sync_every)
            ]
        due = time.monotonic() - self.links[0].started >= self.sync_every_seconds
        if self.num_ranks > 1:  # the island's ranks must agree on when to sync
            flag = torch.tensor([1.0 if due else 0.0], device=self.shards[0].local().device)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
            due = bool(flag.item())
        if not due:
            return []
        for link in self.links:  # the time budget is up while the last exchange is still out
            if link.exchange is not None:
                self._finish(link.exchange)
        return list(self.links)

    def sync(self) -> RoundStats:
        """Push this round's pseudo-gradient to every shard, wait for the outer step and apply it
        (whatever ``overlap_steps`` says; an exchange already in flight is finished first)."""
        self.drain()
        return self._finish(self._begin(list(self.links)))

    def drain(self) -> list[RoundStats]:
        """Wait for the exchanges in flight and apply them (at the end of training)."""
        pending = {id(link.exchange): link.exchange for link in self.links if link.exchange is not None}
        return [self._finish(ex) for ex in pending.values()]

    def _begin(self, links: list[_Link]) -> _Exchange:
        """Encode the links' pseudo-gradients and push them (in the background when overlapping)."""
        started = time.perf_counter()
        owned = [s for link in links for s in link.shards if s.owned]
        with torch.no_grad():
            deltas = [self._start[s.key] - s.local().detach().float() for s in owned]
            if self.keep_last_delta:
                self.last_delta.update({s.key: d.clone() for s, d in zip(owned, deltas, strict=True)})
            # Reuse last round's payload buffers: the previous push of these links is complete.
            payloads = [
                self.codec.encode(d, self._codec_state.setdefault(s.key, {}), out=self._buffers.get(s.key))
                for s, d in zip(owned, deltas, strict=True)
            ]
            del deltas
            snapshot = (
                {s.key: s.local().detach().float().clone() for link in links for s in link.shards}
                if self.overlap_steps
                else None
            )
        self._buffers.update({s.key: p for s, p in zip(owned, payloads, strict=True)})
        lead = links[0]
        losses = lead.losses
        ex = _Exchange(
            links=links,
            round=min(link.round for link in links),
            steps=lead.steps,
            tokens=lead.tokens,
            loss=sum(losses) / len(losses) if losses else None,
            pushed_at=self.inner_steps,
            snapshot=snapshot,
            pushes=[],
            bytes0=self._bytes(links),
            max_payload_numel=max((s.local().numel() for s in owned), default=0),
        )
        for link in links:
            mine = [s for s in link.shards if s.owned]
            link_payloads = [self._buffers[s.key] for s in mine]
            header = self._header(
                pb.PUSH_KIND_DELTA, link.round, mine, link_payloads, self.codec.spec, tokens=ex.tokens, loss=ex.loss
            )
            ex.pushes.append((link, header, link_payloads))
            link.exchange = ex
            link.pushed += 1
            link.steps, link.tokens, link.losses = 0, 0, []
            link.started = time.monotonic()
        if self.overlap_steps:
            ex.thread = threading.Thread(target=self._exchange_io, args=(ex,), name="atoll-exchange", daemon=True)
            ex.thread.start()
        else:
            self._exchange_io(ex)
        ex.blocked += time.perf_counter() - started
        return ex

    def _exchange_io(self, ex: _Exchange) -> None:
        """Push to every link first, then wait for each shard's outer step; no parameter is touched."""
        try:
            for link, header, payloads in ex.pushes:
                self._push(link, header, payloads)
            for link, header, payloads in ex.pushes:
                ex.result = self._pull_until_ready(
                    link,
                    link.round,
                    repush=(header, payloads),
                    on_update=lambda lk, h, pl: ex.updates.append((lk, h, pl)),
                    cancel=self._hb_stop,
                )
        except BaseException as err:  # re-raised in the training loop by _finish
            ex.error = err

    def _finish(self, ex: _Exchange) -> RoundStats:
        """Wait for the exchange (if in the background) and apply its outer update(s)."""
        started = time.perf_counter()
        if ex.thread is not None:
            ex.thread.join()
            ex.thread = None
            log.debug(
                "%s: waited %.3fs for round %d's exchange", self.island_id, time.perf_counter() - started, ex.round
            )
        for link in ex.links:
            link.exchange = None
        if ex.error is not None:
            raise ex.error
        for link, header, payloads in ex.updates:
            self._apply(link, header, payloads)
        for link in ex.links:
            self._set_params(link, ex.snapshot)
        ex.updates = []
        ex.blocked += time.perf_counter() - started
        sent1, recv1 = self._bytes(ex.links)
        kind, global_loss = ex.result
        stats = RoundStats(
            ex.round,
            ex.steps,
            ex.tokens,
            ex.loss,
            global_loss,
            sent1 - ex.bytes0[0],
            recv1 - ex.bytes0[1],
            ex.blocked,
            kind,
            ex.max_payload_numel,
            tuple(link.index for link in ex.links),
        )
        self.history.append(stats)
        return stats

    def _bytes(self, links: list[_Link]) -> tuple[int, int]:
        return (
            sum(link.client.bytes_sent for link in links),
            sum(link.client.bytes_received for link in links),
        )

    def _header(self, kind, round_, shards, payloads, codec, *, tokens=0, loss=None) -> pb.PushHeader:
        h = pb.PushHeader(
            run_id=self.run_id,
            island_id=self.island_id,
            round=round_,
            kind=kind,
            rank=self.rank,
            num_ranks=self.num_ranks,
            tokens=tokens,
            codec=codec,
        )
        if loss is not None:
            h.loss = loss
        for s, payload in zip(shards, payloads, strict=True):
            h.entries.add(name=s.name, offsets=list(s.offsets), sizes=list(s.sizes), num_bytes=len(payload))
        return h

    def _push(self, link: _Link, header: pb.PushHeader, payloads: list) -> bool:
        """Push; returns False when the round closed without us (the work is dropped)."""
        try:
            link.client.push(header, payloads)
            return True
        except grpc.RpcError as err:
            if err.code() == grpc.StatusCode.NOT_FOUND:
                self._join(link)
                return self._push(link, header, payloads)
            if err.code() == grpc.StatusCode.FAILED_PRECONDITION and "closed" in (err.details() or ""):
                log.warning("%s: round %d closed before our push arrived; dropping it", self.island_id, header.round)
                return False
            raise

    def _pull_request(self, link: _Link, have_round: int) -> pb.PullRequest:
        req = pb.PullRequest(
            run_id=self.run_id, island_id=self.island_id, have_round=have_round, wait_seconds=self.pull_wait_seconds
        )
        for s in link.shards:
            if not s.is_full:
                req.regions.add(name=s.name, offsets=list(s.offsets), sizes=list(s.sizes))
            else:
                req.regions.add(name=s.name)
        return req

    def _pull_until_ready(
        self, link: _Link, have_round: int, repush=None, *, on_update, cancel: threading.Event | None = None
    ) -> tuple[str, float | None]:
        """Long-poll until the outer step past ``have_round`` is out; hand each update (several when
        catching up) to ``on_update(link, header, payloads)``. Returns (update kind, global loss).
        ``cancel``: give up between polls once set (the island is closing)."""
        while True:
            if cancel is not None and cancel.is_set():
                raise RuntimeError(f"{self.island_id}: closed while waiting for round {have_round}'s outer step")
            try:
                header, payloads = link.client.pull(self._pull_request(link, have_round))
            except grpc.RpcError as err:
                if err.code() == grpc.StatusCode.NOT_FOUND:
                    self._join(link)
                    continue
                if err.code() == grpc.StatusCode.FAILED_PRECONDITION and have_round >= 0:
                    log.warning("%s: %s; pulling full parameters", self.island_id, err.details())
                    have_round = -1
                    continue
                raise
            if header.kind == pb.UPDATE_KIND_NOT_READY:
                if repush is not None and not header.committed and header.round == have_round:
                    # The coordinator lost our push (it restarted): idempotent, so send it again.
                    log.info("%s: coordinator has no push from us for round %d; re-pushing", self.island_id, have_round)
                    self._push(link, *repush)
                continue
            on_update(link, header, payloads)
            if header.round < header.latest_round:  # several rounds behind: next delta right away
                have_round, repush = header.round, None
                continue
            return pb.UpdateKind.Name(header.kind), (header.loss if header.HasField("loss") else None)

    def _apply(self, link: _Link, header: pb.UpdateHeader, payloads: list) -> None:
        """Advance the link's global θ (``_start``) and round by one update; ``_set_params`` then
        writes it into the model."""
        by_key = {
            (e.name, tuple(e.offsets), tuple(e.sizes)): payload
            for e, (_, payload) in zip(header.entries, payloads, strict=True)
        }
        new = {}
        for s in link.shards:
            key = (s.name, (), ()) if s.is_full else s.key
            if key not in by_key:
                raise RuntimeError(f"update is missing tensor {s.name!r} region {s.offsets}+{s.sizes}")
            # Payloads are self-describing: a sliced region may come as identity, a whole tensor
            # in the downlink codec.
            value = decode_any(by_key[key], s.sizes)
            new[s.key] = value if header.kind == pb.UPDATE_KIND_FULL else self._start[s.key] + value
        self._start.update(new)
        link.round = header.round

    @torch.no_grad()
    def _set_params(self, link: _Link, snapshot: dict[tuple, torch.Tensor] | None = None) -> None:
        """Load the link's global θ into the model; with ``snapshot`` (θ when the exchange was pushed),
        keep the inner progress made since: θ ← θ_global + (θ_now − θ_at_push)."""
        for s in link.shards:
            if snapshot is None:
                s.local().copy_(self._start[s.key])
            else:
                s.local().add_(self._start[s.key] - snapshot[s.key])

    def global_params(self) -> dict[str, torch.Tensor]:
        """This rank's regions of θ for the current round, as received (fp32), keyed by name."""
        return {s.name: self._start[s.key] for s in self.shards}
