"""The island's transport seam, in atoll's own messages (:mod:`atoll.islands._messages`): one
coordinator shard's calls (:class:`Transport`), and the real one (:class:`WireTransport`), the protobuf
client (:class:`~atoll.islands._transport.client.CoordinatorClient`) behind the conversions. What wraps
the seam (the harness's fault injection, ``CoordinatorLink(..., connect=...)``) sees what the island
sends and hears, typed; only this module and the client know the protobuf form.

A call the coordinator refuses raises ``grpc.RpcError`` with its reason in the status details
(:func:`atoll.protos.status.reason_of`): the session acts on the reason, never on the text.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import NamedTuple, Protocol

from atoll.islands._messages import Identity, JoinAnswer, JoinRequest, PushHeader, TensorRegion, Update
from atoll.islands._transport import convert
from atoll.islands._transport.client import CoordinatorClient, RetryPolicy
from atoll.protos import coordinator_pb2 as pb
from atoll.protos.vocabulary import PushOutcome


class Heard(NamedTuple):
    """A heartbeat's answer."""

    round: int
    """The coordinator's open round."""
    run_complete: bool


class Transport(Protocol):
    """One coordinator shard's calls, as the island's session makes them."""

    address: str
    """The address in use (an island given ``primary|standby`` moves on while one is unreachable)."""
    alternatives: list[str]
    retry: RetryPolicy
    bytes_sent: int
    bytes_received: int
    cancel: threading.Event | None
    """Once set, calls retrying an unreachable coordinator give up (SIGTERM)."""

    def join(self, me: Identity, req: JoinRequest, *, give_up_seconds: float | None = None) -> JoinAnswer: ...

    def heartbeat(self, me: Identity, round_: int) -> Heard: ...

    def leave(self, me: Identity, *, give_up_seconds: float | None = None) -> None: ...

    def push(self, me: Identity, header: PushHeader, payloads) -> PushOutcome:
        """``payloads``: the entries' payloads in order, or ``encode(i)`` giving entry i's."""
        ...

    def pull(
        self,
        me: Identity,
        have_round: int,
        *,
        wait_seconds: float,
        regions: list[TensorRegion],
        on_entry: Callable[[Update, int, object], None] | None = None,
    ) -> tuple[Update, list]:
        """One long-poll: the update past ``have_round`` of ``regions`` (its payloads, unless
        ``on_entry`` takes each as it arrives), or NOT_READY with why."""
        ...

    def pin_buffers(self, make: Callable[[int], object]) -> None:
        """Pulled entries land in buffers made by ``make`` (pinned host memory, for a GPU island)."""
        ...

    def close(self) -> None: ...


class WireTransport:
    """The real transport: :class:`Transport` over the protobuf client."""

    def __init__(self, client: CoordinatorClient) -> None:
        self.client = client

    @property
    def address(self) -> str:
        return self.client.address

    @property
    def alternatives(self) -> list[str]:
        return self.client.alternatives

    @property
    def retry(self) -> RetryPolicy:
        return self.client.retry

    @property
    def bytes_sent(self) -> int:
        return self.client.bytes_sent

    @property
    def bytes_received(self) -> int:
        return self.client.bytes_received

    @property
    def cancel(self) -> threading.Event | None:
        return self.client.cancel

    @cancel.setter
    def cancel(self, event: threading.Event | None) -> None:
        self.client.cancel = event

    def join(self, me: Identity, req: JoinRequest, *, give_up_seconds: float | None = None) -> JoinAnswer:
        wire = convert.join_request(me.run_id, me.island_id, me.session_id, req)
        return convert.join_answer(self.client.join(wire, give_up_seconds=give_up_seconds))

    def heartbeat(self, me: Identity, round_: int) -> Heard:
        resp = self.client.heartbeat(
            pb.HeartbeatRequest(run_id=me.run_id, island_id=me.island_id, round=round_, session_id=me.session_id)
        )
        return Heard(resp.round, resp.run_complete)

    def leave(self, me: Identity, *, give_up_seconds: float | None = None) -> None:
        self.client.leave(
            pb.LeaveRequest(run_id=me.run_id, island_id=me.island_id, session_id=me.session_id),
            give_up_seconds=give_up_seconds,
        )

    def push(self, me: Identity, header: PushHeader, payloads) -> PushOutcome:
        return convert.outcome(self.client.push(wire_header(me, header), payloads))

    def pull(self, me: Identity, have_round: int, *, wait_seconds: float, regions: list[TensorRegion], on_entry=None):
        req = pb.PullRequest(
            run_id=me.run_id,
            island_id=me.island_id,
            session_id=me.session_id,
            have_round=have_round,
            wait_seconds=wait_seconds,
            rank=me.rank,
        )
        req.regions.extend(convert.regions(regions))
        header, payloads = self.client.pull(req, on_entry=None if on_entry is None else _entries(on_entry))
        return convert.update(header), payloads

    def pin_buffers(self, make: Callable[[int], object]) -> None:
        self.client.buffers.make = make

    def close(self) -> None:
        self.client.close()


def transport_of(connected) -> Transport:
    """What ``CoordinatorLink(connect=...)`` gave, as the seam: a protobuf client (the seam's form until
    this release) is put behind a :class:`WireTransport`."""
    return WireTransport(connected) if isinstance(connected, CoordinatorClient) else connected


def wire_header(me: Identity, header: PushHeader) -> pb.PushHeader:
    """The push header as the wire carries it (for whoever writes a push by hand: the harness)."""
    return convert.push_header(me.run_id, me.island_id, me.session_id, me.rank, me.num_ranks, header)


def _entries(on_entry: Callable[[Update, int, object], None]):
    """``on_entry`` for the client's reader, which hands each entry over with the wire's header: the
    island's gets the header as an :class:`Update` (converted once per pull)."""
    converted: list = [None, None]

    def apply(header: pb.UpdateHeader, i: int, payload) -> None:
        if converted[0] is not header:
            converted[:] = [header, convert.update(header)]
        on_entry(converted[1], i, payload)

    return apply
