"""One outer exchange in flight (push, wait for the outer step, pull) and the stats of a finished one."""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from atoll.protos import coordinator_pb2 as pb


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


@dataclass(eq=False)
class Flight:
    links: list[int]
    round: int
    steps: int
    tokens: int
    loss: float | None
    pushed_at: int
    """``inner_steps`` when it was pushed."""
    merge: bool
    """Overlap: keep the progress made while the exchange was in flight when applying it."""
    bytes0: tuple[int, int] = (0, 0)
    pushes: list[tuple[int, pb.PushHeader, list]] = field(default_factory=list)
    """(link, header, payloads) per link; payloads are dropped once acknowledged when ``rebuild`` can
    encode them again (a coordinator that restarted asks for them)."""
    rebuild: Callable[[int], list] | None = None
    encoder: Callable[[int], Callable[[int], bytes]] | None = None
    """Streamed pushes: ``encoder(link)(j)`` encodes the link's j-th payload as the stream asks."""
    updates: list[tuple[int, pb.UpdateHeader, list]] = field(default_factory=list)
    """(link, header, payloads) of every update pulled, in order."""
    outcomes: dict[int, int] = field(default_factory=dict)
    """PushOutcome per link."""
    result: tuple[str, float | None] = ("", None)
    max_payload_numel: int = 0
    blocked: float = 0.0
    error: BaseException | None = None
    thread: threading.Thread | None = None

    def source(self, link: int):
        """What to push for a link: its payloads, or an encoder that makes them one at a time."""
        for i, _, payloads in self.pushes:
            if i == link and payloads is not None:
                return payloads
        return self.encoder(link) if self.encoder is not None else self.payloads_of(link)

    def payloads_of(self, link: int) -> list:
        """The link's payloads: kept, or encoded again (the same bytes: see ``rebuild``)."""
        for i, _, payloads in self.pushes:
            if i == link:
                return payloads if payloads is not None else self.rebuild(link)
        raise KeyError(link)

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
            kind,
            self.max_payload_numel,
            tuple(self.links),
            dropped=any(o == pb.PUSH_OUTCOME_ROUND_CLOSED for o in self.outcomes.values()),
            run_complete=run_complete,
        )


def flight_state(f: Flight) -> dict:
    """A flight that was pushed (or is about to be) but not applied, for a checkpoint."""
    return {
        "links": list(f.links),
        "round": f.round,
        "steps": f.steps,
        "tokens": f.tokens,
        "loss": f.loss,
        "pushed_at": f.pushed_at,
        "merge": f.merge,
        "pushes": [
            {
                "link": i,
                "header": _bytes_tensor(h.SerializeToString()),
                "payloads": [_bytes_tensor(p) for p in f.payloads_of(i)],
            }
            for i, h, _ in f.pushes
        ],
    }


def restore_flight(sd: dict, sessions) -> Flight:
    """The flight of :func:`flight_state`, ready to be pushed again (pushes are idempotent)."""
    flight = Flight(
        links=[int(i) for i in sd["links"]],
        round=int(sd["round"]),
        steps=int(sd["steps"]),
        tokens=int(sd["tokens"]),
        loss=sd["loss"],
        pushed_at=int(sd["pushed_at"]),
        merge=bool(sd["merge"]),
    )
    for push in sd["pushes"]:
        header = pb.PushHeader.FromString(push["header"].numpy().tobytes())
        header.session_id = sessions[int(push["link"])].me.session_id
        flight.pushes.append((int(push["link"]), header, [bytearray(p.numpy().tobytes()) for p in push["payloads"]]))
    return flight


def _bytes_tensor(p) -> torch.Tensor:
    return torch.frombuffer(bytearray(p), dtype=torch.uint8) if len(p) else torch.empty(0, dtype=torch.uint8)
