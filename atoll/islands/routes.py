"""An island's links to the coordinator and the outer state of its shards.

One :class:`~atoll.islands.session.Session` per coordinator shard (or Streaming DiLoCo fragment),
with the local shards whose tensors that shard owns; one :class:`~atoll.islands.exchange.ShardState`
per local shard. Joining settles the run's H and codec (a value the island asked for and the run
overrides is refused or warned about, naming both), uploads θ_0 when the island bootstraps, and
heartbeats keep the island's lease from the join on.
"""

from __future__ import annotations

import contextlib
import logging
import math
import threading

import torch
import torch.distributed as dist

from atoll.compression import ErrorFeedback, available_codecs, codec_name, codec_of, get_codec
from atoll.islands.client import CoordinatorClient
from atoll.islands.errors import CoordinatorRefused
from atoll.islands.exchange import Placement, ShardState
from atoll.islands.options import IslandOptions
from atoll.islands.session import Identity, Session
from atoll.islands.shards import BUFFER, LocalShard
from atoll.protos import coordinator_pb2 as pb
from atoll.protos.dtypes import PB_FROM_TORCH
from atoll.sharding import layer_partition, layout_digest, shard_of

log = logging.getLogger("atoll.island")


class Links:
    def __init__(self, options: IslandOptions, shards: list[LocalShard], me: Identity, group=None) -> None:
        self.options = options
        self.shards = shards
        self.me = me
        self.group = group
        addresses = options.addresses
        n = len(addresses)
        digest = ""
        if options.streaming:
            layout = [(s.name, tuple(s.tensor.shape)) for s in shards]
            fragment = layer_partition([(name, math.prod(shape)) for name, shape in layout], n)
            digest = layout_digest(layout)
        else:
            fragment = {s.name: shard_of(s.name, n) for s in shards}
        self.link_shards = [[s for s in shards if fragment[s.name] == i] for i in range(n)]
        empty = [i for i, mine in enumerate(self.link_shards) if not mine]
        if empty:
            raise ValueError(f"coordinator shards {empty} of {n} own none of the model's tensors; use fewer shards")
        placements: dict[torch.device, Placement] = {}
        self.states: dict[tuple, ShardState] = {}
        for s in shards:
            device = s.local().device
            placement = placements.setdefault(device, Placement(options.outer_state, device))
            self.states[s.key] = ShardState(s, placement)
        factory = options.client_factory or CoordinatorClient
        self.sessions = [
            Session(
                i,
                factory(address, retry=options.retry, token=options.token, tls=options.tls),
                me,
                self._join_request_for(i, digest, n),
                _regions(self.link_shards[i]),
                pull_wait_seconds=options.pull_wait_seconds,
            )
            for i, address in enumerate(addresses)
        ]
        self.sync_every = options.sync_every or 0
        self.codec = None
        self._hb_stop = threading.Event()
        self._hb_thread: threading.Thread | None = None

    @property
    def stopping(self) -> threading.Event:
        return self._hb_stop

    def _join_request_for(self, index: int, digest: str, num_shards: int):
        o = self.options
        offered = [codec_name(o.codec)] if o.codec else available_codecs()

        def build() -> pb.JoinRequest:
            req = pb.JoinRequest(
                run_id=self.me.run_id,
                island_id=self.me.island_id,
                session_id=self.me.session_id,
                codecs=offered,
                num_ranks=self.me.num_ranks,
                shard_index=index,
                num_shards=num_shards,
                partition="layers" if o.streaming else "hash",
                layout_digest=digest,
            )
            seen = set()
            for s in self.link_shards[index]:
                if s.name not in seen:
                    seen.add(s.name)
                    kind = pb.TENSOR_KIND_BUFFER if s.kind == BUFFER else pb.TENSOR_KIND_PARAMETER
                    dtype = PB_FROM_TORCH[s.tensor.dtype]
                    req.tensors.add(name=s.name, shape=list(s.tensor.shape), dtype=dtype, kind=kind)
            return req

        return build

    # ---- joining ------------------------------------------------------------------------------
    def join_all(self) -> list[pb.JoinResponse]:
        """Join every link, then start heartbeats (uploading θ_0 or waiting for another island's can
        take longer than a lease)."""
        joined = [self._join(s) for s in self.sessions]
        self._hb_thread = threading.Thread(target=self._heartbeats, name="atoll-heartbeat", daemon=True)
        self._hb_thread.start()
        return joined

    def _join(self, session: Session) -> pb.JoinResponse:
        o = self.options
        resp = session.join(give_up_seconds=o.connect_timeout_seconds)
        c = resp.config
        if o.sync_every is None:
            self.sync_every = c.sync_every
        elif o.sync_every != c.sync_every and session.index == 0:
            log.warning(
                "%s: sync_every=%d overrides the run's H=%d for this island (its deltas cover %d inner steps)",
                self.me.island_id,
                o.sync_every,
                c.sync_every,
                o.sync_every,
            )
        run_codec = get_codec(resp.codec)
        if o.codec and ":" in o.codec and get_codec(o.codec).spec != run_codec.spec:
            raise CoordinatorRefused(
                "REASON_CODEC_MISMATCH",
                f"codec {get_codec(o.codec).spec!r} was asked for; the run uses {run_codec.spec!r} "
                "(pass the codec name alone to take the run's parameters)",
            )
        if self.codec is None:
            decay = c.error_feedback_decay or 1.0  # 0: unset by an older coordinator
            self.codec = ErrorFeedback(run_codec, decay) if c.error_feedback and run_codec.lossy else run_codec
        elif self.codec.spec != run_codec.spec:
            raise RuntimeError(f"coordinator shard {session.index} runs codec {resp.codec}, another {self.codec.spec}")
        if o.overlap_steps and o.sync_every_seconds is None and o.overlap_steps >= self.sync_every:
            raise ValueError(f"overlap_steps ({o.overlap_steps}) must be below the run's H ({self.sync_every})")
        if session.round < 0:
            session.round = resp.round
        log.info(
            "%s[%d/%d] joined run %s (shard %d/%d) at round %d (H=%d, codec %s)",
            self.me.island_id,
            self.me.rank,
            self.me.num_ranks,
            self.me.run_id,
            session.index,
            len(self.sessions),
            resp.round,
            self.sync_every,
            resp.codec,
        )
        return resp

    def bootstrap(self, session: Session) -> None:
        """Upload this rank's owned regions of θ as θ_0 (identity codec)."""
        ident = get_codec("identity")
        owned = [s for s in self.link_shards[session.index] if s.owned]
        sizes = [ident.encoded_size(s.sizes) for s in owned]
        header = session.header(pb.PUSH_KIND_INIT, 0, owned, sizes, "identity")
        session.push(header, lambda j: ident.encode(owned[j].local().detach()))  # one tensor at a time

    def pull_theta(self, session: Session) -> None:
        """Wait for the run's θ (uploading θ_0 if the claim comes to this island) and load it."""
        session.pull_until_ready(
            -1, on_entry=self.entry_applier(session.index), bootstrap=lambda: self.bootstrap(session)
        )
        self.load_params(session.index, merge=False)

    # ---- the exchange ---------------------------------------------------------------------------
    def encode(self, index: int) -> list:
        """The link's owned pseudo-gradients, encoded (on the parameters' device; payloads on the host)."""
        return [self.states[s.key].encode(self.codec) for s in self.owned(index)]

    def encoder(self, index: int):
        """``encode(j)``: the link's j-th owned pseudo-gradient, encoded when the push stream asks."""
        owned = self.owned(index)
        return lambda j: self.states[owned[j].key].encode(self.codec)

    def sizes(self, index: int) -> list[int]:
        """Payload bytes of the link's owned pseudo-gradients, known before encoding."""
        return [self.codec.encoded_size(s.sizes) for s in self.owned(index)]

    def entry_applier(self, index: int):
        """``on_entry(header, i, payload)``: apply one pulled entry to its shard as soon as it arrives."""
        by_key = {((s.name, (), ()) if s.is_full else s.key): s for s in self.link_shards[index]}

        def apply(header: pb.UpdateHeader, i: int, payload) -> None:
            e = header.entries[i]
            s = by_key.get((e.name, tuple(e.offsets), tuple(e.sizes)))
            if s is None:
                raise RuntimeError(
                    f"update entry {e.name!r} {list(e.offsets)}+{list(e.sizes)} is no region of this rank"
                )
            codec_of(payload).frame(payload, s.sizes)  # WireFormatError before it changes anything
            self.states[s.key].apply(payload, header.kind == pb.UPDATE_KIND_FULL)

        return apply

    def owned(self, index: int) -> list[LocalShard]:
        return [s for s in self.link_shards[index] if s.owned]

    def applier(self, session: Session):
        return lambda header, payloads: self.apply_all(session.index, [(header, payloads)])

    def apply_all(self, index: int, updates: list) -> None:
        """Advance the link's θ_start by each update, in order; every payload is checked before any is
        applied, so a corrupt update changes nothing."""
        plans = []
        for header, payloads in updates:
            by_key = {
                (e.name, tuple(e.offsets), tuple(e.sizes)): payload
                for e, (_, payload) in zip(header.entries, payloads, strict=True)
            }
            for s in self.link_shards[index]:
                key = (s.name, (), ()) if s.is_full else s.key
                if key not in by_key:
                    raise RuntimeError(f"update is missing tensor {s.name!r} region {s.offsets}+{s.sizes}")
                codec_of(by_key[key]).frame(by_key[key], s.sizes)  # WireFormatError before anything changes
                plans.append((s, by_key[key], header.kind == pb.UPDATE_KIND_FULL))
        for s, payload, full in plans:
            self.states[s.key].apply(payload, full)

    def load_params(self, index: int, merge: bool) -> None:
        for s in self.link_shards[index]:
            self.states[s.key].load_into_param(merge)

    def bytes(self, indices: list[int]) -> tuple[int, int]:
        return (
            sum(self.sessions[i].client.bytes_sent for i in indices),
            sum(self.sessions[i].client.bytes_received for i in indices),
        )

    # ---- heartbeats and leaving -----------------------------------------------------------------
    def _heartbeats(self) -> None:
        while not self._hb_stop.wait(self.options.heartbeat_seconds):
            for s in list(self.sessions):
                try:
                    s.heartbeat()
                except (ValueError, AttributeError):  # channel closed under us during shutdown
                    return
                except Exception as err:  # a heartbeat must never kill the island; the next one retries
                    log.info("heartbeat to shard %d failed: %s", s.index, err)

    def stop_heartbeats(self) -> None:
        self._hb_stop.set()
        if self._hb_thread is not None:
            self._hb_thread.join(timeout=5)
            self._hb_thread = None

    def close(self, leave: bool) -> None:
        """Stop heartbeats and, on rank 0 with ``leave``, leave the run; close the channels."""
        self.stop_heartbeats()
        if self.me.num_ranks > 1:
            with contextlib.suppress(RuntimeError):  # a peer may already be gone
                dist.barrier(group=self.group)
        if leave and self.me.rank == 0:
            for s in self.sessions:
                s.leave()
        for s in self.sessions:
            s.client.close()


def _regions(shards: list[LocalShard]) -> list[pb.TensorEntry]:
    out = []
    for s in shards:
        if s.is_full:
            out.append(pb.TensorEntry(name=s.name))
        else:
            out.append(pb.TensorEntry(name=s.name, offsets=list(s.offsets), sizes=list(s.sizes)))
    return out
