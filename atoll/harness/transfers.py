"""Transfers as a network or an older client would make them, for the benchmarks that time resumed
and admitted pushes: a push cut part way through, a push that waits a round trip for its admission,
and a client's kept connections dropped. The harness reaches into the island's transport here (as its
fault injection does); the benchmarks call only this and the public client."""

from __future__ import annotations

import time

from atoll.harness.cuts import reset
from atoll.islands import CoordinatorClient
from atoll.islands._transport.kept import KeptConnections
from atoll.islands._transport.tcp_streams import TcpPush
from atoll.islands._transport.transfer import write_push
from atoll.protos import coordinator_pb2 as pb


def push_cut_and_retried(
    client: CoordinatorClient, header: pb.PushHeader, payloads: list, fraction: float, streams: int
) -> tuple[pb.PushResponse, int]:
    """The push's first ``fraction`` of bytes sent on the bulk port over ``streams`` connections, which
    are then cut (a reset, once what was sent is acknowledged) as a link that dies does; then retried
    as the client retries (waiting for its admission, which says where the coordinator holds it from).
    Returns the retry's answer and the payload bytes it sent again."""
    stream = TcpPush(client.bulk, header, auth="", timeout=60, streams=streams)
    left = int(sum(len(p) for p in payloads) * fraction)
    for payload in payloads:
        take = min(len(payload), left)
        if take > 0:
            stream.send(memoryview(payload)[:take])
        left -= take
    for sock in stream.sent_so_far():
        reset(sock)
    time.sleep(0.2)  # the coordinator sees the connection end
    retry = client.open_push(header)
    response = write_push(retry, header, payloads)
    return response, sum(len(p) for p in payloads) - retry.resumed_from


def push_after_admission(client: CoordinatorClient, header: pb.PushHeader, payloads: list) -> pb.PushResponse:
    """The push as clients made it before eager pushes: its data waits for the admission's round trip."""
    return client.call("PushDelta", lambda: write_push(client.open_push(header, eager=False), header, payloads))


def drop_connections(client: CoordinatorClient) -> None:
    """Close the connections the client keeps between calls: its next call opens new ones."""
    client.kept.close()
    client.kept = KeptConnections()
