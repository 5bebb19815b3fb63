"""One outer exchange in flight (its pushes, its updates as they come, its timing) and its form in a
checkpoint, and the stats of a finished one (:class:`RoundStats`, what ``step()`` returns)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from atoll.islands._messages import Pulled, PushHeader, Update
from atoll.islands._transport.convert import push_header_from_wire
from atoll.protos.vocabulary import PushOutcome


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
    background_seconds: float = 0.0
    """The island's own work that ran on the exchange's thread, off the training loop (overlap: the
    pushed θ's encoding, the update's checks and the merge's delta): hidden while the exchange fits
    in the overlap window and the host has a core for it."""


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
    encode_later: Callable[[], None] | None = None
    """Overlap: encodes the pushes' payloads from θ as pushed, first thing on the exchange's thread
    (the training thread trains on meanwhile); they are read only once :attr:`encoded` is set."""
    encoded: threading.Event = field(default_factory=lambda: _set(threading.Event()))
    go: threading.Event = field(default_factory=lambda: _set(threading.Event()))
    """Set once ``before_push`` answered (:attr:`ready`): the pushes wait for it, on the exchange's thread."""
    cancelled: bool = False
    """``before_push`` failed: the exchange's thread pushes nothing."""
    background: float = 0.0
    """The island's own work that ran on the exchange's thread (:attr:`RoundStats.background_seconds`)."""
    merge_ready: bool = False
    """Overlap: every update arrived and is applied to θ_start, and each shard's merge delta is made
    (on the exchange's thread): what is left is adding the deltas to the parameters."""
    merge_fence: Callable[[], None] = lambda: None
    """Waits, on the training thread's streams, for the device work that made the merge deltas."""
    lock: threading.Lock = field(default_factory=threading.Lock)
    """Held while the merge deltas are made, and by a checkpoint reading the flight and its shards."""
    encode_error: BaseException | None = None
    """Why the encoding on the exchange's thread failed (a checkpoint waiting for it raises it)."""

    def wait_encoded(self) -> None:
        """Until the payloads exist (encoded on the exchange's thread); raises its error if that failed."""
        self.encoded.wait()
        if self.encode_error is not None:
            raise self.encode_error

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
            background_seconds=self.background,
        )


def _set(event: threading.Event) -> threading.Event:
    event.set()
    return event


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
        # Its updates are in θ_start and its merge deltas made (the shards' state holds both): on
        # restore it is merged with no exchange again.
        "merge_ready": f.merge_ready,
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
    flight.merge_ready = bool(sd.get("merge_ready", False))
    return flight


def _bytes_tensor(p) -> torch.Tensor:
    return torch.frombuffer(bytearray(p), dtype=torch.uint8) if len(p) else torch.empty(0, dtype=torch.uint8)
