"""Which of an island's local shards each coordinator shard owns, and the outer state of each.

A *route* is the local shards one coordinator shard owns, indexed as the link's sessions (route i
goes to session i); a *local shard* is a rank's region of a tensor. One
:class:`~atoll.islands._shard_state.ShardState` per local shard; the shards routed to each
coordinator shard (hash of the tensor name, or Streaming DiLoCo's contiguous fragments). Joining
settles the run's H and codec (a value the island asked for and the run overrides is warned about,
naming both; a codec spec the run does not use is refused by the coordinator at Join); θ_0 is
uploaded when the island bootstraps; pulled updates are checked whole, then applied.
"""

from __future__ import annotations

import logging
import math

import torch

from atoll.compression import ErrorFeedback, available_codecs, codec_of, get_codec
from atoll.compression.staging import DeviceStaging, pinned_buffer
from atoll.islands._link import CoordinatorLink
from atoll.islands._messages import (
    JoinAnswer,
    JoinRequest,
    Pulled,
    PushKind,
    PushOutcome,
    Region,
    TensorDecl,
    Update,
    UpdateKind,
)
from atoll.islands._options import DiLoCoOptions
from atoll.islands._shard_state import Placement, ShardState
from atoll.islands._shards import BUFFER, LocalShard
from atoll.islands._transport.session import Session
from atoll.memory import Leases
from atoll.sharding import layer_partition, layout_digest, shard_of

log = logging.getLogger("atoll.island")


class Routes:
    def __init__(
        self,
        options: DiLoCoOptions,
        shards: list[LocalShard],
        link: CoordinatorLink,
        rank: int,
        num_ranks: int,
        aliases: dict[str, tuple[str, ...]] | None = None,
        card: str = "",
    ) -> None:
        """Routes ``shards`` to the link's coordinator shards and opens the link (no call yet).
        ``aliases``: tied weights' other names, declared at Join (``atoll export`` writes them);
        ``card``: the model card (JSON) declared at Join."""
        self.options = options
        self.aliases = aliases or {}
        self.card = card
        self.shards = shards
        self.link = link
        n = len(link.addresses)
        digest = ""
        if options.streaming:
            layout = [(s.name, tuple(s.tensor.shape)) for s in shards]
            fragment = layer_partition([(name, math.prod(shape)) for name, shape in layout], n)
            digest = layout_digest(layout)
        else:
            fragment = {s.name: shard_of(s.name, n) for s in shards}
        self.route_shards = [[s for s in shards if fragment[s.name] == i] for i in range(n)]
        empty = [i for i, mine in enumerate(self.route_shards) if not mine]
        if empty:
            raise ValueError(f"coordinator shards {empty} of {n} own none of the model's tensors; use fewer shards")
        placements: dict[torch.device, Placement] = {}
        stagings: dict[torch.device, DeviceStaging] = {}
        self.leases = Leases()
        """Who reads the shards' push payloads now (see :meth:`ShardState.encode`)."""
        self.states: dict[tuple, ShardState] = {}
        for s in shards:
            device = s.local().device
            placement = placements.setdefault(device, Placement(options.outer_state, device))
            staging = stagings.setdefault(device, DeviceStaging(device, enabled=options.staged_copies))
            self.states[s.key] = ShardState(s, placement, self.leases, staging if staging.enabled else None)
        self.stagings = [st for st in stagings.values() if st.enabled]
        """The devices whose payloads are staged: a payload is read only once :meth:`on_host` says so."""
        self.sessions = link.open(
            rank,
            num_ranks,
            [self._join_request_for(i, digest, n, rank, num_ranks) for i in range(n)],
            [_regions(mine) for mine in self.route_shards],
            group=options.process_group,
        )
        if any(st.cuda for st in self.stagings):  # pulled entries land in pinned memory, reused
            for session in self.sessions:
                session.client.buffers.make = pinned_buffer
        self.sync_every = options.sync_every or 0
        self.decoupled = False
        """The run's outer mode is decoupled: the island never waits for an outer step (see DiLoCo.step)."""
        self.push_behind = 0
        """Decoupled: push before H steps once the run is this many rounds past the island's θ (half the
        run's max_staleness, at least 1), so the delta arrives fresh enough to be folded."""
        self.codec = None

    def _join_request_for(self, index: int, digest: str, num_shards: int, rank: int, num_ranks: int):
        o = self.options
        # A spec with parameters travels whole: the coordinator refuses it at Join if it is not the run's.
        offered = [o.codec] if o.codec else available_codecs()

        def build() -> JoinRequest:
            tensors = {}
            for s in self.route_shards[index]:
                tensors.setdefault(
                    s.name,
                    TensorDecl(
                        s.name,
                        tuple(s.tensor.shape),
                        s.tensor.dtype,
                        buffer=s.kind == BUFFER,
                        aliases=tuple(self.aliases.get(s.name, ())),
                    ),
                )
            return JoinRequest(
                codecs=tuple(offered),
                tensors=tuple(tensors.values()),
                num_ranks=num_ranks,
                shard_index=index,
                num_shards=num_shards,
                partition="layers" if o.streaming else "hash",
                layout_digest=digest,
                model_card=self.card,
            )

        return build

    def complete(self) -> bool:
        """Every coordinator shard says the run is complete."""
        return all(s.run_complete for s in self.sessions)

    # ---- joining ------------------------------------------------------------------------------
    def settle(self, joined: list[JoinAnswer]) -> None:
        """Take the run's H and codec from the shards' Join answers (the island's own H is warned about
        when it differs; every shard must run the same codec)."""
        o = self.options
        for session, resp in zip(self.sessions, joined, strict=True):
            c = resp.run
            if o.sync_every is None:
                self.sync_every = c.sync_every
            elif o.sync_every != c.sync_every and session.index == 0:
                log.warning(
                    "%s: sync_every=%d overrides the run's H=%d for this island (its deltas cover %d inner steps)",
                    self.link.island_id,
                    o.sync_every,
                    c.sync_every,
                    o.sync_every,
                )
            self.decoupled = c.outer_mode == "decoupled"
            self.push_behind = max(1, c.max_staleness // 2)
            run_codec = get_codec(resp.codec)
            if self.codec is None:
                ef = c.error_feedback and run_codec.lossy
                self.codec = ErrorFeedback(run_codec, c.error_feedback_decay) if ef else run_codec
            elif self.codec.spec != run_codec.spec:
                raise RuntimeError(
                    f"coordinator shard {session.index} runs codec {resp.codec}, another {self.codec.spec}"
                )
            if o.overlap_steps and self.decoupled and session.index == 0:
                log.warning("%s: overlap_steps is ignored in a decoupled run", self.link.island_id)
            elif o.overlap_steps and o.sync_every_seconds is None and o.overlap_steps >= self.sync_every:
                raise ValueError(f"overlap_steps ({o.overlap_steps}) must be below the run's H ({self.sync_every})")
            if session.round < 0:
                session.round = resp.round
            me = session.me
            log.info(
                "%s[%d/%d] joined run %s (shard %d/%d) at round %d (H=%d, codec %s, %s)",
                me.island_id,
                me.rank,
                me.num_ranks,
                me.run_id,
                session.index,
                len(self.sessions),
                resp.round,
                self.sync_every,
                resp.codec,
                "decoupled" if self.decoupled else "sync",
            )

    def bootstrap(self, session: Session) -> bool:
        """Upload this rank's owned regions of θ as θ_0 (identity codec); True when they are the run's
        θ_0 and this rank holds nothing else of it (it then has θ_0 already: no pull of it back)."""
        ident = get_codec("identity")
        shards = self.route_shards[session.index]
        owned = [s for s in shards if s.owned]
        sizes = [ident.encoded_size(s.sizes) for s in owned]
        header = session.header(PushKind.INIT, 0, owned, sizes, "identity")
        outcome = session.push(header, lambda j: ident.encode(owned[j].local().detach()))  # one tensor at a time
        return outcome is PushOutcome.COMMITTED and len(owned) == len(shards)

    def pull_theta(self, session: Session) -> None:
        """Wait for the run's θ (uploading θ_0 if the claim comes to this island) and load it."""
        kind, _ = session.pull_until_ready(
            -1, on_entry=self.entry_applier(session.index), bootstrap=lambda: self.bootstrap(session)
        )
        if kind is Pulled.BOOTSTRAPPED:
            self.keep_own_theta(session)
        else:
            self.load_params(session.index, merge=False)

    def keep_own_theta(self, session: Session) -> None:
        """The run's θ_0 is this rank's own upload (:meth:`bootstrap` said so): θ_start is the fp32 of
        its θ, exactly what the upload decodes to."""
        session.round = max(session.round, 0)
        for s in self.route_shards[session.index]:
            self.states[s.key].start_from_local()

    # ---- the exchange ---------------------------------------------------------------------------
    def encode(self, index: int) -> list:
        """The route's owned pseudo-gradients, encoded (on the parameters' device; payloads on the host)."""
        return [self.states[s.key].encode(self.codec) for s in self.owned(index)]

    def encoder(self, index: int):
        """``encode(j)``: the route's j-th owned pseudo-gradient, encoded when the push stream asks."""
        owned = self.owned(index)
        return lambda j: self.on_host([self.states[owned[j].key].encode(self.codec)])[0]

    def on_host(self, payloads: list) -> list:
        """``payloads`` on the host and sealed: a staged encode returns before its copy to the host is
        done; whoever reads the bytes (the push's I/O) waits for that copy here, not the training thread."""
        for staging in self.stagings:
            for p in payloads:
                staging.settle(p)
        return payloads

    def sizes(self, index: int) -> list[int]:
        """Payload bytes of the route's owned pseudo-gradients, known before encoding."""
        return [self.codec.encoded_size(s.sizes) for s in self.owned(index)]

    def entry_applier(self, index: int):
        """``on_entry(header, i, payload)``: apply one pulled entry to its shard as soon as it arrives."""
        by_key = {((s.name, (), ()) if s.is_full else s.key): s for s in self.route_shards[index]}

        def apply(header: Update, i: int, payload) -> None:
            e = header.entries[i]
            s = by_key.get(e.key)
            if s is None:
                raise RuntimeError(
                    f"update entry {e.name!r} {list(e.offsets)}+{list(e.sizes)} is no region of this rank"
                )
            codec_of(payload).frame(payload, s.sizes)  # WireFormatError before it changes anything
            self.states[s.key].apply(payload, header.kind is UpdateKind.FULL, verified=True)

        return apply

    def owned(self, index: int) -> list[LocalShard]:
        return [s for s in self.route_shards[index] if s.owned]

    def apply_all(self, index: int, updates: list) -> None:
        """Advance the route's θ_start by each update, in order; every payload is checked before any is
        applied, so a corrupt update changes nothing."""
        plans = []
        for header, payloads in updates:
            by_key = {e.key: payload for e, (_, payload) in zip(header.entries, payloads, strict=True)}
            for s in self.route_shards[index]:
                key = (s.name, (), ()) if s.is_full else s.key
                if key not in by_key:
                    raise RuntimeError(f"update is missing tensor {s.name!r} region {s.offsets}+{s.sizes}")
                codec_of(by_key[key]).frame(by_key[key], s.sizes)  # WireFormatError before anything changes
                plans.append((s, by_key[key], header.kind is UpdateKind.FULL))
        for s, payload, full in plans:
            self.states[s.key].apply(payload, full, verified=True)

    def load_params(self, index: int, merge: bool) -> None:
        for s in self.route_shards[index]:
            self.states[s.key].load_into_param(merge)


def _regions(shards: list[LocalShard]) -> list[Region]:
    return [Region(s.name) if s.is_full else Region(s.name, tuple(s.offsets), tuple(s.sizes)) for s in shards]
