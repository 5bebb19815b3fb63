"""``atoll plan``: what a run costs on a given link, before it runs, and which settings to pick.

For each candidate (codec × H × overlap × streaming fragments) it gives the bytes each island moves
per round each way (the runtime's own codec sizes: ``Codec.encoded_size`` of every tensor), the time
one outer exchange takes over the link, and the share of wall time the accelerators compute.

The link model is the bulk port's behaviour as measured over the emulated WAN
(:mod:`atoll.harness.netlink`, ``benchmarks/wan_transfer.py``):

- a push's data follows its header at once (an island's first attempt does not wait for its
  admission: ``bulk.EAGER``) and its answer comes half a round trip after its last byte arrives; a
  pull's first byte arrives one round trip after its request;
- in a run's steady state a call takes the connections the calls before it kept (``kept``): no
  handshake, and the windows start where they were (Linux keeps a connection's slow-start threshold
  over idle time; kept calls measured 0.78-0.89 of the link's rate after 2 s idle), so the data
  moves at the link's rate from its first byte. With ``kept=False`` (a coordinator that keeps none,
  or a run's first round) a call first opens its connections (one round trip, one more for TLS),
  and each starts at 10 segments and doubles each round trip until the call's share of the link is
  in flight (TCP slow start); then it moves at the link's rate less the packets' headers;
- one connection carries at most ``window`` bytes per round trip (its send buffer: ~2.7 MB with
  Linux's default 4 MiB ``tcp_wmem``), so a call is striped over ``streams`` connections (the
  island's own choice from the round trip, :func:`atoll.islands._transport.opening.auto_streams`);
- with loss, each connection is held to the Mathis bound, MSS / RTT · 1.22 / √p (Reno's; BBR,
  Linux's default here, does better, so this errs slow).

An exchange is the push, the coordinator's work, and the pull. The coordinator decodes each island's
push into the round's sum as it commits, one push at a time (under its lock: ``decode_seconds`` a
push, :data:`DECODE_SECONDS_PER_PARAM` per codec), then makes the outer step (``outer_seconds``,
:data:`OUTER_SECONDS_PER_PARAM`: the downlink's encoding, θ's finiteness check and the round's record
streamed to disk in it) and makes the record durable (:data:`RECORD_SECONDS`); the first two
measured on one CPU thread at 124M (``benchmarks/coordinator_costs.py``; a running daemon's own
figures are in its history records, ``decode_seconds`` and ``outer_step_seconds``). With
``overlap_steps`` τ the island keeps computing and waits only for what is left after τ steps; with P
streaming fragments each exchange moves 1/P of the model, P times a round.

``host_seconds`` is the island's own work per round on its training thread (the pseudo-gradient,
its encoding, decoding and applying the update): on an accelerator it runs on the device in well
under a step (the default, 0); an island computing on its CPU reads it from its rounds
(``RoundStats.host_seconds``: ~1.1 s at 124M int8 on 2 cores, 4 s with DCT top-k,
``benchmarks/wan_utilisation.py``). Overlap does not hide it; but an overlapping island does most of
that work on its exchange's thread (``background_seconds``, ``RoundStats.background_seconds``: the
encoding of θ as pushed, the update's check and apply, the merge's delta), which then has to fit in
the τ steps with the exchange, and leaves on the training thread the snapshot's copy and the merge's
add (``host_seconds``: 0.24 s at 124M ``sparse``). A plain exchange streams it: the update
is decoded and applied entry by entry as the pull brings it (taken as the coordinator's decode of
one push in the downlink codec: the same pass over θ), and a stateless codec encodes each payload as
the push sends it (the rest of ``host_seconds``), so each direction takes the longer of its transfer
and its share of the work.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace

CODEC_ORDER = ("identity", "bf16", "int8", "int4", "int2", "sparse", "dcttopk", "topk")
"""Codecs from the least to the most lossy (the order the table lists them)."""
CODEC_TIER = {"identity": 0, "bf16": 0, "fp16": 0, "int8": 0, "int4": 1}
"""What the recommendation weighs first: int8 both ways trains as identity does here (benchmarks/RESULTS.md,
"End to end"); int4 a little lossier; the rest (int2, top-k, DCT top-k, sparse) lossier still. (sparse
with its default error feedback decay, 0.9, stayed below identity over 80 rounds of H=30, two seeds, but
was +23.7% after 24 rounds of H=100; with β = 1 +10.6% after 80 rounds of H=30 and +46% at H=30 under
Muon: "Issue 52"; ask for it with ``--codec sparse``.)"""
HEADER_BYTES = 52
"""IPv4 + TCP with timestamps, per packet."""
DECODE_SECONDS_PER_PARAM = {
    "identity": 1.35e-9,
    "bf16": 1.55e-9,
    "fp16": 1.38e-9,
    "int8": 1.65e-9,
    "int4": 3.64e-9,
    "int2": 3.77e-9,
    "topk": 0.63e-9,
    "dcttopk": 6.47e-9,
    "powersgd": 1.29e-9,
    "sparse": 1.02e-9,
}
"""The coordinator's decoding of one push into the round's sum, per parameter, one CPU thread
(``python benchmarks/coordinator_costs.py`` at 124M, benchmarks/RESULTS.md; ``sparse`` re-measured
after its set bits were found by ``nonzero_static``: 1.37 -> 1.02 ns)."""
OUTER_SECONDS_PER_PARAM = 5.7e-9
"""The coordinator's outer step per parameter, one CPU thread, with the downlink's encoding (int8 or
identity: the same), θ's finiteness check and the record streamed to disk (the same benchmark)."""
OUTER_SECONDS_PER_PARAM_BY_DOWNLINK = {"sparse": 10.2e-9}
"""The same for a downlink whose encoding costs more than int8's: ``sparse``'s per-chunk top-k, on the sum
of three ``sparse`` pushes (at most 3/128 of it nonzero: 1.27 s at 124M on one thread,
``coordinator_costs.py --sum-density 0.0234375``; 1.92-1.97 s on a dense sum, against int8's 0.68 s;
the daemon logged 1.2-1.4 s in ``wan_utilisation.py``'s runs: benchmarks/RESULTS.md "Issue 52")."""
RELAY_SECONDS_PER_PARAM = {
    "identity": 5.03e-9,
    "bf16": 5.29e-9,
    "int8": 5.92e-9,
    "int4": 6.70e-9,
    "sparse": 10.23e-9,
}
"""A relay's own work in a round per parameter, one CPU thread, besides decoding its islands' pushes
(:data:`DECODE_SECONDS_PER_PARAM` each): their mean encoded in the run's codec with the relay's error
feedback (a lossy codec: the mean, plus the residual, encoded, decoded, the new residual), and the
update it pulls applied to its θ with the payload kept to serve its islands
(``benchmarks/coordinator_costs.py --relays``, at 124M; ``sparse``'s on a dense mean, the dearest
case). The relay's work is serial with its hops: it encodes the whole mean before its push, and
applies the whole update before its islands pull it. It was priced as one decode each way (0.41 s at
124M int8, against 0.85 s measured), and ``wan_utilisation.py --relays 1`` measured the relayed
exchange 1.05 s longer than planned: benchmarks/RESULTS.md, "Issue 56". Measured again once the relay
encoded through :class:`~atoll.compression.ErrorFeedback` in its mean's own storage: its int8 encode
0.73x, 0.74 s in all at 124M.)"""
RECORD_SECONDS = 0.02
"""Each exchange's record made durable before its update is served (its header, fsync, rename): the
coordinator's ``persist_seconds``, 0.01-0.04 s an exchange in ``benchmarks/wan_utilisation.py``'s runs."""


def outer_per_param(downlink: str) -> float:
    """The outer step's seconds per parameter with ``downlink`` (a spec) as the update's codec."""
    from atoll.compression import codec_name

    return OUTER_SECONDS_PER_PARAM_BY_DOWNLINK.get(codec_name(downlink), OUTER_SECONDS_PER_PARAM)


def relay_per_param(name: str) -> float:
    """:data:`RELAY_SECONDS_PER_PARAM` of a codec by its name (the dearest figure for one not timed)."""
    return RELAY_SECONDS_PER_PARAM.get(name, max(RELAY_SECONDS_PER_PARAM.values()))


def decode_per_param(name: str) -> float:
    """:data:`DECODE_SECONDS_PER_PARAM` of a codec by its name (the dearest figure for one not timed)."""
    return DECODE_SECONDS_PER_PARAM.get(name, max(DECODE_SECONDS_PER_PARAM.values()))


@dataclass(frozen=True, kw_only=True)
class Link:
    rate_mbit: float
    rtt_ms: float
    loss: float = 0.0
    mtu: int = 1500
    window_bytes: float = 2.7e6
    """What one TCP connection keeps in flight at most (its send buffer's share)."""
    tls: bool = True
    kept: bool = True
    """Calls reuse the connections of the calls before (the runtime's steady state)."""

    def __post_init__(self) -> None:
        if self.rate_mbit <= 0 or self.rtt_ms < 0 or not 0 <= self.loss < 1 or self.mtu < 576:
            raise ValueError("need rate_mbit > 0, rtt_ms >= 0, 0 <= loss < 1 and mtu >= 576")

    @property
    def rtt(self) -> float:
        return self.rtt_ms / 1e3

    @property
    def mss(self) -> int:
        return self.mtu - HEADER_BYTES

    @property
    def payload_rate(self) -> float:
        """Bytes a second of payload at the link's rate (the rest is the packets' headers)."""
        return self.rate_mbit * 1e6 / 8 * self.mss / self.mtu


def streams_for(link: Link, limit: int = 8) -> int:
    """The connections the island stripes a call over on this link (its rule, from the round trip)."""
    if link.rtt < 0.005:
        return 1
    return max(2, min(limit, math.ceil(link.rtt / 0.020)))


def data_seconds(nbytes: float, link: Link, streams: int) -> float:
    """Seconds from a call's first data byte sent to its last received, slow start included."""
    if nbytes <= 0:
        return 0.0
    rtt = link.rtt
    per_stream = link.window_bytes / rtt if rtt > 0 else math.inf
    if link.loss > 0 and rtt > 0:
        per_stream = min(per_stream, link.mss / rtt * 1.22 / math.sqrt(link.loss))
    rate = min(link.payload_rate, streams * per_stream)
    if rtt == 0:
        return nbytes / rate
    first = streams * 10 * link.mss  # every connection's first flight
    target = rate * rtt  # in flight once the call fills its share
    if link.kept:
        first = max(first, target)  # the windows are open already
    rounds = max(0, math.ceil(math.log2(max(target / first, 1.0))))
    ramp = first * (2**rounds - 1)  # bytes sent while ramping
    if nbytes <= ramp:
        return math.ceil(math.log2(nbytes / first + 1)) * rtt + rtt / 2
    return rounds * rtt + (nbytes - ramp) / rate + rtt / 2


def setup_seconds(link: Link) -> float:
    """Opening a call's connections: TCP's handshake (and TLS's), none on kept ones."""
    return 0.0 if link.kept else (2 if link.tls else 1) * link.rtt


def push_seconds(nbytes: float, link: Link, streams: int) -> float:
    return setup_seconds(link) + data_seconds(nbytes, link, streams) + link.rtt / 2  # the data right away; the answer


def pull_seconds(nbytes: float, link: Link, streams: int) -> float:
    return setup_seconds(link) + link.rtt / 2 + data_seconds(nbytes, link, streams)  # the request, then the data


@dataclass(frozen=True, kw_only=True)
class Candidate:
    codec: str
    sync_every: int
    overlap_steps: int
    fragments: int


@dataclass(frozen=True, kw_only=True)
class Estimate:
    codec: str
    downlink_codec: str
    sync_every: int
    overlap_steps: int
    fragments: int
    streams: int
    bytes_up_per_round: int
    bytes_down_per_round: int
    sync_seconds: float
    """One outer exchange (all fragments' for a streaming run) on the link and at the coordinator: what
    ``RoundStats.exchange_seconds`` measures with overlap (a plain exchange's figure leaves out the
    island's own work that streams with its transfers, so there ``stall_seconds`` compares with the
    island's ``sync_seconds``)."""
    coordinator_seconds: float
    """Of ``sync_seconds``, the coordinator's work: decoding every island's push, the outer step, the
    record's write (a round's: every fragment's exchange)."""
    compute_seconds: float
    """One round's inner steps."""
    stall_seconds: float
    """What of a round's exchanges the accelerators wait for."""
    utilisation: float

    def as_dict(self) -> dict:
        return asdict(self)


def downlink_for(codec: str) -> str:
    """The update codec the plan gives an island codec: identity for plain DiLoCo, else what a run
    that names none gets (:func:`atoll.compression.downlink_for`: sparse for sparse, int8)."""
    from atoll.compression import downlink_for as rule

    return "identity" if codec == "identity" else rule(codec)


def sizes(shapes: list[tuple[int, ...]], codec: str) -> int:
    from atoll.compression import get_codec

    c = get_codec(codec)
    return sum(c.encoded_size(s) for s in shapes)


def estimate(
    cand: Candidate,
    *,
    shapes: list[tuple[int, ...]],
    step_seconds: float,
    islands: int,
    link: Link,
    outer_seconds: float | None = None,
    decode_seconds: float | None = None,
    coordinator_mbit: float | None = None,
    host_seconds: float = 0.0,
    background_seconds: float = 0.0,
    relays: int = 0,
    site: Link | None = None,
) -> Estimate:
    """``relays``: the islands sit behind this many relays (``atoll relay``), evenly; ``link`` is then
    each relay's link to the root and ``site`` the islands' to their relay (default: 10 Gbit/s, 0.5 ms).
    A relay waits for its islands, decodes each, encodes their mean, pushes it, and applies the update it
    pulls before serving it: the root decodes one push per relay."""
    from atoll.compression import get_codec

    params = sum(math.prod(s) for s in shapes)
    down = downlink_for(cand.codec)
    up_bytes, down_bytes = sizes(shapes, cand.codec), sizes(shapes, down)
    streams = streams_for(link)
    outer = outer_per_param(down) * params if outer_seconds is None else outer_seconds
    codec = get_codec(cand.codec)
    decode = decode_per_param(codec.name) * params if decode_seconds is None else decode_seconds
    p = cand.fragments
    members = relays or islands  # what the root takes a push from
    coordinator = members * decode + outer + p * RECORD_SECONDS  # the pushes decode one after another
    push = push_seconds(up_bytes / p, link, streams)
    if coordinator_mbit:  # every member's push into the coordinator's own link
        shared = replace(link, rate_mbit=coordinator_mbit)
        push = max(push, push_seconds(members * up_bytes / p, shared, streams * members))
    pull = pull_seconds(down_bytes / p, link, streams)
    if coordinator_mbit:
        pull = max(pull, pull_seconds(members * down_bytes / p, shared, streams * members))
    near_push = near_pull = 0.0  # the legs an island's own streamed work overlaps: its own link's
    if relays:  # the site's hop each way, on the relay's own link, and the relay's work between
        site = site or Link(rate_mbit=10_000.0, rtt_ms=0.5)
        fan, near = math.ceil(islands / relays), streams_for(site)
        near_push = push_seconds(fan * up_bytes / p, site, near * fan)
        near_pull = pull_seconds(fan * down_bytes / p, site, near * fan)
        coordinator += fan * decode + relay_per_param(codec.name) * params  # its islands' pushes; its own work
    push, pull = push + near_push, pull + near_pull
    exchange = push + coordinator / p + pull
    compute = cand.sync_every * step_seconds
    hidden = cand.overlap_steps * step_seconds
    if cand.overlap_steps:  # the own work on the training thread; the exchange and its thread's work behind τ steps
        stall = p * max(0.0, exchange + background_seconds / p - hidden) + host_seconds
    else:  # streamed with the transfers: the apply with the pull, a stateless codec's encoding with the push
        apply = min(host_seconds, decode_per_param(get_codec(down).name) * params) / p
        encode = host_seconds / p - apply
        # Behind a relay the island's own work streams with its hop to the relay, not with the relay's
        # hop to the root: the relay pushes once it has every push, and serves once it has the update.
        first = near_push if relays else push
        out = push + encode if codec.stateful else push - first + max(first, encode)
        last = near_pull if relays else pull
        stall = p * (out + coordinator / p + pull - last + max(last, apply))
    busy = max(compute + stall, p * exchange if cand.overlap_steps else 0.0)  # the link carries one at a time
    return Estimate(
        codec=cand.codec,
        downlink_codec=down,
        sync_every=cand.sync_every,
        overlap_steps=cand.overlap_steps,
        fragments=p,
        streams=streams,
        bytes_up_per_round=up_bytes,
        bytes_down_per_round=down_bytes,
        sync_seconds=p * exchange,
        coordinator_seconds=coordinator,
        compute_seconds=compute,
        stall_seconds=stall,
        utilisation=compute / busy,
    )


def overlap_for(exchange: float, step_seconds: float, sync_every: int, fragments: int, max_overlap: float) -> int:
    """The overlap τ that hides one exchange, at most ``max_overlap`` of H / P (the next fragment's turn)."""
    if step_seconds <= 0:
        return 0
    most = max(int(max_overlap * sync_every / fragments), 1)
    return max(1, min(math.ceil(exchange / step_seconds), most, sync_every - 1))


def candidates(
    codecs: list[str], sync_every: list[int], overlap: list[bool], fragments: list[int]
) -> list[tuple[str, int, bool, int]]:
    return [(c, h, o, p) for c in codecs for h in sync_every for o in overlap for p in fragments if h >= 2 * p]


def plan(
    *,
    shapes: list[tuple[int, ...]],
    step_seconds: float,
    islands: int,
    link: Link,
    codecs: list[str],
    sync_every: list[int],
    overlap: list[bool],
    fragments: list[int],
    outer_seconds: float | None = None,
    decode_seconds: float | None = None,
    coordinator_mbit: float | None = None,
    host_seconds: float = 0.0,
    background_seconds: float = 0.0,
    relays: int = 0,
    site: Link | None = None,
    target: float = 0.97,
    max_overlap: float = 0.5,
) -> list[Estimate]:
    """Every candidate's estimate, the recommended first: of those that reach ``target`` utilisation,
    the least lossy codec tier (:data:`CODEC_TIER`), then the smallest H, then the least overlap
    (``max_overlap``: the most of H / P an update may come late by), then no fragments; the best
    utilisation if none reaches it. The rest follow by utilisation."""
    kw = dict(
        shapes=shapes,
        step_seconds=step_seconds,
        islands=islands,
        link=link,
        outer_seconds=outer_seconds,
        decode_seconds=decode_seconds,
        coordinator_mbit=coordinator_mbit,
        host_seconds=host_seconds,
        background_seconds=background_seconds,
        relays=relays,
        site=site,
    )
    out = []
    for codec, h, over, p in candidates(codecs, sync_every, overlap, fragments):
        tau = 0
        if over:
            plain = estimate(Candidate(codec=codec, sync_every=h, overlap_steps=0, fragments=p), **kw)
            tau = overlap_for(plain.sync_seconds / p, step_seconds, h, p, max_overlap)
        out.append(estimate(Candidate(codec=codec, sync_every=h, overlap_steps=tau, fragments=p), **kw))

    def quality(e: Estimate):
        order = CODEC_ORDER.index(e.codec) if e.codec in CODEC_ORDER else len(CODEC_ORDER)
        return (CODEC_TIER.get(e.codec, 2), e.sync_every, e.overlap_steps, e.fragments, order)

    good = sorted((e for e in out if e.utilisation >= target), key=quality)
    chosen = good[0] if good else max(out, key=lambda e: e.utilisation)
    rest = sorted((e for e in out if e is not chosen), key=lambda e: (-e.utilisation, quality(e)))
    return [chosen, *rest]
