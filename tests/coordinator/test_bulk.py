"""The bulk port: pushes and pulls as plain TCP streams, with exactly gRPC's outcomes."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import inspect
import json
import socket
import threading
import time
import warnings
from types import SimpleNamespace

import grpc
import pytest
import torch
from support import exact_config, wait_for

from atoll.coordinator.options import NetworkOptions, SecurityOptions
from atoll.coordinator.transport.security import IslandTokens
from atoll.harness.cuts import reset
from atoll.islands._transport.client import BulkPort, CoordinatorClient, PartialUpdate, RetryPolicy
from atoll.islands._transport.streams import End
from atoll.islands._transport.tcp_streams import TcpPush
from atoll.islands._transport.transfer import write_push
from atoll.protos import bulk
from atoll.protos import coordinator_pb2 as pb
from atoll.protos.reasons import Reason
from atoll.protos.status import reason_of

SHAPES = {"w": (300, 70), "b": (5,), "empty": (0,)}


def scenario(start_server, raw_island, state_dir, **server_kwargs):
    """θ_0, two islands' deltas for round 0, a pull of round 1: (pulled header, payloads, counters)."""
    srv = start_server(exact_config(run_id="t", sync_every=1, quorum=2), state_dir, **server_kwargs)
    gen = torch.Generator().manual_seed(5)
    a, b = raw_island(srv.address, "a", SHAPES), raw_island(srv.address, "b", SHAPES)
    joined = [a.join(), b.join()]
    a.push({k: torch.randn(s, generator=gen) for k, s in SHAPES.items()}, round_=0, kind=pb.PUSH_KIND_INIT)
    for isl, tokens in ((a, 10), (b, 30)):
        out = isl.push({k: torch.randn(s, generator=gen) for k, s in SHAPES.items()}, round_=0, tokens=tokens)
        assert out.outcome in (pb.PUSH_OUTCOME_STAGED, pb.PUSH_OUTCOME_COMMITTED)
    header, payloads = a.pull(have_round=0)
    return joined, header, [bytes(p) for _, p in payloads], srv.server.counters.as_dict()


def test_a_round_over_the_bulk_port_equals_one_over_grpc(start_server, raw_island, tmp_path):
    joined, header, pulled, counters = scenario(start_server, raw_island, tmp_path / "bulk")
    assert joined[0].bulk_port > 0 and joined[0].bulk_port == joined[1].bulk_port
    joined_g, header_g, pulled_g, counters_g = scenario(
        start_server, raw_island, tmp_path / "grpc", network=NetworkOptions(bulk_port=None)
    )
    assert joined_g[0].bulk_port == 0
    assert header.kind == header_g.kind == pb.UPDATE_KIND_DELTA and header.round == header_g.round == 1
    assert pulled == pulled_g  # the same update, byte for byte
    assert sum(map(len, pulled)) == sum(e.num_bytes for e in header.entries) > 300 * 70 * 4
    # Three pushes and one pull came on the bulk port; the bytes counted are the same either way.
    assert counters["bulk_calls"] == 4 and counters_g["bulk_calls"] == 0
    assert counters["bytes_in"] == counters_g["bytes_in"] > 2 * 300 * 70 * 4
    assert counters["bytes_out"] == counters_g["bytes_out"] == sum(map(len, pulled))


def test_refusals_carry_their_code_and_reason(start_server, raw_island):
    srv = start_server(exact_config(run_id="t", sync_every=1))
    a = raw_island(srv.address, "a", SHAPES)
    a.join()
    stranger = raw_island(srv.address, "nobody", SHAPES)
    stranger.client.bulk = a.client.bulk  # never joined, so only the bulk port can carry its push
    with pytest.raises(grpc.RpcError) as info:
        stranger.push({k: torch.zeros(s) for k, s in SHAPES.items()}, round_=0, kind=pb.PUSH_KIND_INIT)
    assert info.value.code() == grpc.StatusCode.NOT_FOUND
    assert reason_of(info.value) is Reason.NOT_JOINED
    assert srv.server.counters.bulk_calls == 1


def test_a_refusal_part_way_reaches_the_client_and_stops_its_data(start_server, raw_island):
    """A corrupt first entry is refused while the client is still sending: it gets INVALID_ARGUMENT
    (not a reset connection, which it would retry), and stops sending."""
    srv = start_server(exact_config(run_id="t", sync_every=1))
    a = raw_island(srv.address, "a", {"w": (4 << 20,), "b": (16 << 20,)})
    a.join()
    from atoll.compression import get_codec

    ident = get_codec("identity")
    good = ident.encode(torch.randn(4 << 20))
    corrupt = bytearray(good)
    corrupt[100] ^= 0xFF
    h = pb.PushHeader(run_id="t", island_id="a", round=0, kind=pb.PUSH_KIND_INIT, num_ranks=1, codec="identity")
    h.entries.add(name="w", num_bytes=len(good))
    h.entries.add(name="b", num_bytes=len(ident.encode(torch.zeros(16 << 20))))  # 64 MiB, never to be sent
    sent = []

    def pieces():
        yield corrupt
        for _ in range(64):
            sent.append(1)
            yield bytes(1 << 20)

    with pytest.raises(grpc.RpcError) as info:
        port = a.client.bulk
        write_push(TcpPush(port, h, auth="", timeout=5), h, pieces())
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "crc32" in info.value.details()
    assert len(sent) < 64  # refused at the first bad chunk, not after the 64 MiB behind it


def test_a_first_push_attempt_sends_its_data_without_waiting_a_round_trip_for_admission():
    """An island's first attempt of a push asks for no CONTINUE (``bulk.EAGER``): its data follows the
    preamble at once. A stand-in coordinator that reads the whole push before it answers anything gets
    every byte, and the island takes its one answer; a retry waits for admission (it may resume)."""
    lsock = socket.create_server(("127.0.0.1", 0))
    lsock.settimeout(10)
    payloads = [bytes(range(256)) * 4096, b"\x07" * 3000]  # 1 MiB and a bit
    got: dict = {}

    def coordinator() -> None:
        conn, _ = lsock.accept()
        with conn:
            conn.settimeout(10)

            def exact(n: int) -> bytes:
                buf = b""
                while len(buf) < n:
                    part = conn.recv(n - len(buf))
                    if not part:
                        raise EOFError(f"{len(buf)} of {n} bytes")
                    buf += part
                return buf

            _, method, auth_len = bulk.PREAMBLE.unpack(exact(bulk.PREAMBLE.size))
            exact(auth_len)
            (length,) = bulk.LENGTH.unpack(exact(bulk.LENGTH.size))
            header = pb.PushChunk.FromString(exact(length)).header
            got["method"] = method
            got["data"] = exact(sum(e.num_bytes for e in header.entries))  # before saying anything
            answer = pb.PushResponse(committed=True, outcome=pb.PUSH_OUTCOME_STAGED)
            conn.sendall(bulk.frame(bulk.OK, answer.SerializeToString()))

    server = threading.Thread(target=coordinator, daemon=True)
    server.start()
    client = CoordinatorClient("127.0.0.1:1", retry=RetryPolicy(give_up_seconds=5))
    client.bulk = BulkPort("127.0.0.1", lsock.getsockname()[1])
    h = pb.PushHeader(run_id="t", island_id="a", round=0, kind=pb.PUSH_KIND_DELTA, num_ranks=1, codec="identity")
    for name, p in zip("wb", payloads, strict=True):
        h.entries.add(name=name, num_bytes=len(p))
    try:
        assert client.push(h, payloads).outcome == pb.PUSH_OUTCOME_STAGED
    finally:
        client.close()
        server.join(10)
        lsock.close()
    assert got["method"] == bulk.PUSH | bulk.EAGER and got["data"] == b"".join(payloads)


@pytest.mark.parametrize("streams", [1, 3])
def test_an_eager_push_refused_or_answered_at_its_header_leaves_nothing_behind(start_server, raw_island, streams):
    """An eager push whose data is on its way when the coordinator refuses it at its header (or answers
    it there: a duplicate) gets that answer, not a broken connection, and stops; the coordinator reads
    what came into nothing, keeps no such connection, and the next calls go on as before."""
    srv = start_server(exact_config(run_id="t", sync_every=1, quorum=2))
    gen = torch.Generator().manual_seed(8)
    a, b = (
        raw_island(srv.address, "a", BIG, bulk_streams=streams),
        raw_island(srv.address, "b", BIG, bulk_streams=streams),
    )
    a.join()
    b.join()
    stranger = raw_island(srv.address, "nobody", BIG, bulk_streams=streams)
    stranger.client.bulk = a.client.bulk  # never joined: refused at the header, its 11.8 MiB coming anyway
    for _ in range(2):
        with pytest.raises(grpc.RpcError) as info:
            stranger.push({k: torch.randn(s, generator=gen) for k, s in BIG.items()}, round_=0, kind=pb.PUSH_KIND_INIT)
        assert reason_of(info.value) is Reason.NOT_JOINED
    a.push({k: torch.randn(s, generator=gen) for k, s in BIG.items()}, round_=0, kind=pb.PUSH_KIND_INIT)
    delta = {k: torch.randn(s, generator=gen) for k, s in BIG.items()}
    first = a.push(delta, round_=0, tokens=3)
    again = a.push(delta, round_=0, tokens=3)  # on the connections the first kept; answered at its header
    assert first.outcome == pb.PUSH_OUTCOME_COMMITTED and again.outcome == pb.PUSH_OUTCOME_DUPLICATE
    counters = srv.server.counters
    assert counters.bytes_in == first.bytes_received >= 4 * sum(t.numel() for t in delta.values())  # once
    b.push({k: torch.randn(s, generator=gen) for k, s in BIG.items()}, round_=0, tokens=1)
    header, _ = a.pull(have_round=0)  # on fresh connections: the duplicate's were not kept
    assert header.round == 1 and counters.bulk_calls == 7
    wait_for(lambda: srv.server.bulk.connections == 2 * streams, what="the refused calls' connections closed")
    assert counters.bulk_timeouts == 0
    # What came of the three pushes answered at their header was read into nothing, and counted (a client
    # stops at its next entry once it sees the answer: on loopback, often before its first).
    assert counters.resent_bytes["push_unread"] <= 3 * first.bytes_received
    assert counters.resent_bytes["push_cut"] == counters.resent_bytes["pull_again"] == 0


def test_island_tokens_hold_on_the_bulk_port(start_server, raw_island, tmp_path):
    path = tmp_path / "tokens.json"
    path.write_text(json.dumps({"a": "ta", "b": "tb"}))
    srv = start_server(exact_config(run_id="t", sync_every=1), security=SecurityOptions(tokens=IslandTokens.load(path)))
    a = raw_island(srv.address, "a", SHAPES)
    a.client = CoordinatorClient(srv.address, retry=RetryPolicy(give_up_seconds=5), token="ta")
    port = a.join().bulk_port
    refused = [("", "UNAUTHENTICATED"), ("Bearer wrong", "UNAUTHENTICATED"), ("Bearer tb", "PERMISSION_DENIED")]
    for auth, code in refused:
        h = pb.PushHeader(run_id="t", island_id="a", round=0, kind=pb.PUSH_KIND_INIT, num_ranks=1, codec="identity")
        h.entries.add(name="w", num_bytes=8)
        with pytest.raises(grpc.RpcError) as info:
            write_push(TcpPush(BulkPort("127.0.0.1", port), h, auth=auth, timeout=5), h, [bytes(8)])
        assert info.value.code().name == code, auth
    a.push({k: torch.zeros(s) for k, s in SHAPES.items()}, round_=0, kind=pb.PUSH_KIND_INIT)  # its own token
    assert srv.server.state.model.ready
    a.client.close()


def test_a_connection_accepted_as_the_port_stops_is_closed_by_the_stop():
    """A connection the port accepted just before it stopped, its call not begun, is closed by the stop:
    not left open to the garbage collector (CI once failed on that socket's ResourceWarning, raised in a
    later test). The client is connected before the port starts, so its accept is the port's first step."""
    from atoll.coordinator.transport.bulk_port import BulkServer
    from atoll.coordinator.transport.counters import Counters

    async def accept_then_stop() -> socket.socket:
        port = BulkServer(SimpleNamespace(counters=Counters()), host="127.0.0.1", port=0, tokens=None, idle_seconds=5)
        client = socket.create_connection(("127.0.0.1", port.port), timeout=5)
        await port.start()
        for _ in range(10):  # until the port accepts it: its call's task made, its first step to come
            await asyncio.sleep(0)
            if port.servicer.counters.bulk_connections:
                break
        calls = [inspect.getcoroutinestate(task.get_coro()) for task in port._calls]
        await port.stop()
        assert calls == [inspect.CORO_CREATED]
        return client

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        client = asyncio.run(accept_then_stop())
        gc.collect()
    with client:
        assert client.recv(1) == b""  # closed by the stop
    assert not [str(w.message) for w in seen if issubclass(w.category, ResourceWarning)]


def test_the_port_takes_connections_again_after_an_accept_fails():
    """An accept that fails (out of descriptors) pauses accepting for a moment, then the port takes the
    connection that waited: it is served, not left in the backlog."""
    from atoll.coordinator.transport.bulk_port import BulkServer
    from atoll.coordinator.transport.counters import Counters

    class OutOfDescriptorsOnce:
        def __init__(self, sock: socket.socket) -> None:
            self.sock, self.failed = sock, 0

        def accept(self):
            if not self.failed:
                self.failed += 1
                raise OSError(24, "Too many open files")
            return self.sock.accept()

        def __getattr__(self, name):
            return getattr(self.sock, name)

    async def fail_then_serve() -> tuple[int, int]:
        port = BulkServer(SimpleNamespace(counters=Counters()), host="127.0.0.1", port=0, tokens=None, idle_seconds=5)
        port._sock = OutOfDescriptorsOnce(port._sock)
        await port.start()
        try:
            client = await asyncio.to_thread(socket.create_connection, ("127.0.0.1", port.port), 5)
            with client:
                for _ in range(200):
                    if port.servicer.counters.bulk_connections:
                        break
                    await asyncio.sleep(0.01)
            return port._sock.failed, port.servicer.counters.bulk_connections
        finally:
            await port.stop()

    assert asyncio.run(fail_then_serve()) == (1, 1)


def test_junk_and_silence_are_dropped_and_the_port_keeps_serving(start_server, raw_island):
    srv = start_server(exact_config(run_id="t", sync_every=1), network=NetworkOptions(stream_idle_seconds=0.5))
    a = raw_island(srv.address, "a", SHAPES)
    port = a.join().bulk_port
    with socket.create_connection(("127.0.0.1", port), timeout=5) as junk:
        junk.sendall(b"GET / HTTP/1.1\r\n\r\n")
        assert hung_up(junk)  # without an answer
    with socket.create_connection(("127.0.0.1", port), timeout=5) as huge:
        huge.sendall(bulk.PREAMBLE.pack(bulk.MAGIC, bulk.PUSH, 0) + bulk.LENGTH.pack(1 << 31))
        assert hung_up(huge)  # a message over the limit is never read
    with socket.create_connection(("127.0.0.1", port), timeout=5) as silent:
        silent.sendall(bulk.MAGIC)  # then nothing
        assert hung_up(silent)
        assert srv.server.counters.bulk_timeouts == 1  # closed for its silence
    a.push({k: torch.zeros(s) for k, s in SHAPES.items()}, round_=0, kind=pb.PUSH_KIND_INIT)
    assert srv.server.counters.bulk_calls == 1 and srv.server.state.model.ready


def test_a_trickled_preamble_and_too_many_connections_are_cut_off(start_server, raw_island):
    """A preamble has a deadline, not an idle limit (a byte now and then does not keep a connection),
    and connections past the cap are closed as they come; then the port serves as before."""
    srv = start_server(exact_config(run_id="t", sync_every=1), network=NetworkOptions(stream_idle_seconds=1.0))
    a = raw_island(srv.address, "a", SHAPES)
    port = a.join().bulk_port
    counters = srv.server.counters
    trickle = bulk.PREAMBLE.pack(bulk.MAGIC, bulk.PUSH, 0) * 20  # 200 bytes at 4 a second: 50 s of progress
    with socket.create_connection(("127.0.0.1", port), timeout=10) as slow:
        sent = 0
        with contextlib.suppress(OSError):
            for byte in trickle:
                slow.sendall(bytes([byte]))
                sent += 1
                if counters.bulk_timeouts:
                    break
                time.sleep(0.25)
        assert hung_up(slow) and counters.bulk_timeouts == 1  # cut off for its deadline...
        assert sent < 20  # ...about 1 s in (its deadline), not when the 50 s of trickle end
    srv.server.bulk.max_connections = 2
    held = [socket.create_connection(("127.0.0.1", port), timeout=5) for _ in range(2)]
    try:
        wait_for(lambda: srv.server.bulk.connections == 2, what="both connections accepted")
        with socket.create_connection(("127.0.0.1", port), timeout=5) as third:
            assert hung_up(third)
        assert counters.bulk_over_cap == 1 and counters.bulk_timeouts == 1  # at once, not at a deadline
    finally:
        for sock in held:
            sock.close()
    wait_for(lambda: srv.server.bulk.connections == 0, what="the held connections closed")
    a.push({k: torch.zeros(s) for k, s in SHAPES.items()}, round_=0, kind=pb.PUSH_KIND_INIT)
    assert srv.server.state.model.ready


def hung_up(sock: socket.socket) -> bool:
    """The server closed the connection (a reset when it left bytes unread)."""
    try:
        return sock.recv(100) == b""
    except ConnectionResetError:
        return True


def test_an_unreachable_bulk_port_falls_back_to_grpc(start_server, raw_island):
    srv = start_server(exact_config(run_id="t", sync_every=1))
    a = raw_island(srv.address, "a", SHAPES)
    a.join()
    closed = socket.create_server(("127.0.0.1", 0))
    dead_port = closed.getsockname()[1]
    closed.close()
    a.client.bulk = BulkPort("127.0.0.1", dead_port)
    out = a.push({k: torch.zeros(s) for k, s in SHAPES.items()}, round_=0, kind=pb.PUSH_KIND_INIT)
    assert out.outcome == pb.PUSH_OUTCOME_COMMITTED
    assert a.client.bulk is None and srv.server.counters.bulk_calls == 0
    assert a.join().bulk_port and a.client.bulk is not None  # a new Join takes the advertised port again


def test_a_pull_that_breaks_after_an_applied_entry_is_a_partial_update():
    """A fake bulk port sends an update's header, its first entry and half the second, then hangs up:
    the island, having applied one entry, gets PartialUpdate (it then pulls the full θ), no retry."""
    header = pb.UpdateHeader(kind=pb.UPDATE_KIND_DELTA, round=1)
    header.entries.add(name="a", num_bytes=1000)
    header.entries.add(name="b", num_bytes=1000)
    server = socket.create_server(("127.0.0.1", 0))
    calls = []

    def serve():
        conn, _ = server.accept()
        calls.append(1)
        with conn:
            conn.recv(1 << 16)
            conn.sendall(bulk.frame(bulk.OK, header.SerializeToString()) + bytes(1500))

    t = threading.Thread(target=serve)
    t.start()
    client = CoordinatorClient("127.0.0.1:1", retry=RetryPolicy(give_up_seconds=5, rpc_timeout_seconds=5))
    try:
        client.bulk = BulkPort("127.0.0.1", server.getsockname()[1])
        applied = []
        with pytest.raises(PartialUpdate, match="after 1 entries"):
            client.pull(pb.PullRequest(have_round=0), on_entry=lambda h, i, p: applied.append(bytes(p)))
        assert applied == [bytes(1000)] and calls == [1]
    finally:
        t.join(10)
        server.close()
        client.close()


BIG = {"w": (1 << 20,), "b": (300, 70), "c": (700_001,), "empty": (0,)}
"""Entries that cross the 1 MiB units of a striped call's data in every way (11.8 MiB in all)."""


def striped_round(start_server, raw_island, state_dir, streams):
    srv = start_server(exact_config(run_id="t", sync_every=1, quorum=2), state_dir)
    gen = torch.Generator().manual_seed(11)
    a = raw_island(srv.address, "a", BIG, bulk_streams=streams)
    b = raw_island(srv.address, "b", BIG, bulk_streams=streams)
    joined = a.join()
    b.join()
    a.push({k: torch.randn(s, generator=gen) for k, s in BIG.items()}, round_=0, kind=pb.PUSH_KIND_INIT)
    for isl, n in ((a, 10), (b, 30)):
        isl.push({k: torch.randn(s, generator=gen) for k, s in BIG.items()}, round_=0, tokens=n)
    _, payloads = a.pull(have_round=0)
    return joined, [bytes(p) for _, p in payloads], srv.server.counters.as_dict()


def test_a_call_striped_over_several_connections_moves_the_same_bytes(start_server, raw_island, tmp_path):
    joined, one, counters = striped_round(start_server, raw_island, tmp_path / "one", 1)
    assert joined.bulk_streams == bulk.MAX_STREAMS
    for streams in (2, 3, 5):
        _, striped, counters_s = striped_round(start_server, raw_island, tmp_path / f"s{streams}", streams)
        assert striped == one, streams  # the same update, byte for byte
        assert counters_s["bulk_calls"] == counters["bulk_calls"] == 4
        assert counters_s["bytes_in"] == counters["bytes_in"] > 3 * 4 * (1 << 20)


def test_a_striped_call_whose_connections_do_not_match_is_refused(start_server, raw_island):
    srv = start_server(exact_config(run_id="t", sync_every=1))
    a = raw_island(srv.address, "a", SHAPES)
    port = a.join().bulk_port
    call = bytes(range(16))
    h = pb.PullRequest(run_id="t", island_id="a", have_round=-1).SerializeToString()
    with socket.create_connection(("127.0.0.1", port), timeout=5) as lead:
        lead.sendall(bulk.preamble(bulk.PULL_STRIPED, "", bulk.STRIPE.pack(call, 0, 2) + h))
        with socket.create_connection(("127.0.0.1", port), timeout=5) as side:  # another authorization
            side.sendall(bulk.preamble(bulk.SIDE, "Bearer x", bulk.STRIPE.pack(call, 1, 2)))
            assert hung_up(side)
        with socket.create_connection(("127.0.0.1", port), timeout=5) as side:  # another count
            side.sendall(bulk.preamble(bulk.SIDE, "", bulk.STRIPE.pack(call, 1, 3)))
            assert hung_up(side)
    with socket.create_connection(("127.0.0.1", port), timeout=5) as lead:  # more than MAX_STREAMS
        lead.sendall(bulk.preamble(bulk.PULL_STRIPED, "", bulk.STRIPE.pack(call, 0, bulk.MAX_STREAMS + 1) + h))
        assert hung_up(lead)
    a.push({k: torch.zeros(s) for k, s in SHAPES.items()}, round_=0, kind=pb.PUSH_KIND_INIT)
    assert srv.server.state.model.ready
    wait_for(lambda: srv.server.bulk._stripes == {}, timeout=15, what="the refused calls' stripes forgotten")


def test_the_stream_count_follows_the_round_trip(start_server, raw_island):
    from atoll.islands._transport.opening import auto_streams

    assert [auto_streams(None, 16), auto_streams(0.0004, 16), auto_streams(0.05, 16), auto_streams(0.08, 16)] == [
        1,
        1,
        3,
        4,
    ]
    assert auto_streams(0.5, 8) == 8 and auto_streams(0.5, 1) == 1 and auto_streams(0.006, 8) == 2
    srv = start_server(exact_config(run_id="t", sync_every=1))
    a = raw_island(srv.address, "a", SHAPES)
    a.join()
    # Loopback: measured at Join, and every call keeps to one connection.
    assert a.client.rtt is not None and a.client.rtt < 0.005
    assert a.client.streams_for(a.client.bulk) == 1


def cut_first_attempt(client, at: int) -> list[bool]:
    """Cut the island's first attempt of its next push after ``at`` bytes of its data (every byte put on
    the wire first, then its connections reset); returns each attempt's ``eager``, as they open."""
    real_open, opened = client.open_push, []

    def open_push(header, *, eager=False):
        stream = real_open(header, eager=eager)
        opened.append(eager)
        if len(opened) > 1:
            return stream
        real_send, sent = stream.send, 0

        def send(payload) -> bool:
            nonlocal sent
            view = memoryview(payload).cast("B")
            take = min(view.nbytes, at - sent)
            real_send(view[:take])
            sent += take
            if sent < at:
                return True
            stream._ready.put(End)  # let the sender put every byte on the wire, then cut
            stream._sender.join()
            for sock in stream._socks:
                reset(sock)
            raise bulk.broken("cut")

        stream.send = send
        return stream

    client.open_push = open_push
    return opened


@pytest.mark.parametrize("streams", [1, 3])
def test_a_push_cut_part_way_resumes_where_it_broke(start_server, raw_island, tmp_path, streams):
    """A push whose first attempt (eager) is cut at 90% is retried from what the coordinator holds: at
    most 15% goes again, and the round's update is the same, bit for bit, as without the cut."""
    from atoll.compression import get_codec

    identity = get_codec("identity")
    gen = torch.Generator().manual_seed(3)
    theta0 = {k: torch.randn(s, generator=gen) for k, s in BIG.items()}
    delta = {k: torch.randn(s, generator=gen) for k, s in BIG.items()}
    updates = []
    for cut in (False, True):
        srv = start_server(exact_config(run_id="t", sync_every=1), tmp_path / f"cut{cut}")
        a = raw_island(srv.address, "a", BIG, bulk_streams=streams)
        a.join()
        a.push(theta0, round_=0, kind=pb.PUSH_KIND_INIT)
        payloads = [identity.encode(t) for t in delta.values()]
        h = pb.PushHeader(run_id="t", island_id="a", round=0, kind=pb.PUSH_KIND_DELTA, num_ranks=1, tokens=5)
        h.codec = "identity"
        for name, p in zip(delta, payloads, strict=True):
            h.entries.add(name=name, num_bytes=len(p))
        total = sum(map(len, payloads))
        opened = cut_first_attempt(a.client, int(0.9 * total)) if cut else []
        assert a.client.push(h, payloads).committed
        counters = srv.server.counters
        if cut:
            assert opened[0] and not any(opened[1:])  # only the first attempt went without admission
            assert counters.bulk_resumes == 1
            assert counters.bulk_resumed_bytes >= 0.85 * total  # what went again: at most 15%
        else:
            assert counters.bulk_resumes == 0
        assert counters.resent_bytes["push_cut"] == 0  # resumed: nothing that came was dropped
        _, pulled = a.pull(have_round=0)
        updates.append([bytes(p) for _, p in pulled])
    assert updates[0] == updates[1]


def test_a_pull_cut_part_way_asks_for_the_rest(start_server, raw_island, tmp_path):
    """A pull whose connection is reset half way through its data asks for the rest of the same answer
    (its entries already applied stay applied) instead of the full θ: the update is the same, bit for
    bit, and the bytes before the cut are not sent again."""
    srv = start_server(exact_config(run_id="t", sync_every=1))
    gen = torch.Generator().manual_seed(4)
    a = raw_island(srv.address, "a", BIG, bulk_streams=1)
    a.join()
    a.push({k: torch.randn(s, generator=gen) for k, s in BIG.items()}, round_=0, kind=pb.PUSH_KIND_INIT)
    a.push({k: torch.randn(s, generator=gen) for k, s in BIG.items()}, round_=0, tokens=3)
    whole = [bytes(p) for _, p in a.pull(have_round=0)[1]]
    total, at = sum(map(len, whole)), sum(map(len, whole)) // 2
    client, opened = a.client, []
    real_open = client.open_pull

    def open_pull(req):  # the first attempt is reset once half of its data is in
        stream = real_open(req)
        opened.append(req.resume_offset)
        if len(opened) == 1:
            read = stream.read_into

            def read_into(view):
                first = max(at - stream.delivered, 0)
                if first < view.nbytes and not stream._socks[0]._closed:
                    read(view[:first])
                    for sock in stream._socks:
                        reset(sock)
                    view = view[first:]
                read(view)

            stream.read_into = read_into
        return stream

    client.open_pull = open_pull
    applied = []
    header, _ = client.pull(
        pb.PullRequest(run_id="t", island_id="a", have_round=0, wait_seconds=5),
        on_entry=lambda h, i, p: applied.append(bytes(p)),
    )
    assert header.round == 1 and applied == whole  # each entry once, the same bytes
    assert opened[0] == 0 and len(opened) == 2 and at - (1 << 20) <= opened[1] <= at
    assert srv.server.counters.bulk_pull_resumes == 1
    assert srv.server.counters.bulk_resumed_bytes == opened[1]
    # What the resumed answer skipped is not counted as sent (the cut attempt counts what it made before
    # it noticed the reset: timing).
    assert total + (total - opened[1]) < srv.server.counters.bytes_out <= 3 * total - opened[1]
    # The same answer went three times: whole, cut, and its rest; all but the first are counted again,
    # less what the resumed one skipped.
    assert srv.server.counters.resent_bytes["pull_again"] == srv.server.counters.bytes_out - total


def test_the_rest_of_an_answer_comes_striped_too(start_server, raw_island):
    """What a resumed pull asks for, over three connections: the answer's data from the offset on."""
    from atoll.islands._transport.tcp_streams import TcpPull

    srv = start_server(exact_config(run_id="t", sync_every=1))
    gen = torch.Generator().manual_seed(4)
    a = raw_island(srv.address, "a", BIG)
    a.join()
    a.push({k: torch.randn(s, generator=gen) for k, s in BIG.items()}, round_=0, kind=pb.PUSH_KIND_INIT)
    a.push({k: torch.randn(s, generator=gen) for k, s in BIG.items()}, round_=0, tokens=3)
    data = b"".join(bytes(p) for _, p in a.pull(have_round=0)[1])
    for offset in (1, (3 << 20) + 5, len(data) - 7):
        req = pb.PullRequest(run_id="t", island_id="a", have_round=0, resume_offset=offset)
        stream = TcpPull(a.client.bulk, req, auth="", timeout=10, streams=3)
        assert stream.header().round == 1
        rest = memoryview(bytearray(len(data) - offset))
        stream.read_into(rest)
        stream.close()
        assert bytes(rest) == data[offset:] and stream.delivered == len(data)


@pytest.mark.parametrize("streams", [1, 3])
def test_connections_are_kept_from_call_to_call(start_server, raw_island, tmp_path, streams):
    """A call that ended cleanly leaves its connections open and the next takes them: nine pushes and
    pulls on the connections the first push opened, the same bytes as connections opened for every call."""
    srv = start_server(exact_config(run_id="t", sync_every=1), tmp_path / "kept")
    gen = torch.Generator().manual_seed(12)
    a = raw_island(srv.address, "a", BIG, bulk_streams=streams)
    joined = a.join()
    assert joined.bulk_keep_seconds == bulk.KEEP_SECONDS and a.client.bulk.keep_seconds == bulk.KEEP_SECONDS
    counters = srv.server.counters
    before = counters.bulk_connections  # (the Join's round-trip probe)
    a.push({k: torch.randn(s, generator=gen) for k, s in BIG.items()}, round_=0, kind=pb.PUSH_KIND_INIT)
    pulled = []
    for r in range(4):
        a.push({k: torch.randn(s, generator=gen) for k, s in BIG.items()}, round_=r, tokens=3)
        header, payloads = a.pull(have_round=r)
        assert header.round == r + 1
        pulled.append([bytes(p) for _, p in payloads])
    assert counters.bulk_calls == 9
    assert counters.bulk_connections - before == streams  # every call on the first call's connections
    assert counters.bulk_kept_calls == 8
    assert a.client.kept.idle(a.client.bulk) == streams
    assert srv.server.bulk.connections == streams  # waiting for the next call
    # The coordinator closes a kept connection past its keep time; the island then opens a new one.
    srv.server.bulk.keep_seconds = 0.5
    a.push({k: torch.randn(s, generator=gen) for k, s in BIG.items()}, round_=4, tokens=3)  # (the old limit)
    wait_for(lambda: srv.server.bulk.connections == 0, timeout=10, what="the idle connections closed")
    assert counters.bulk_timeouts == 0  # an idle kept connection is no stalled call
    header, _ = a.pull(have_round=4)
    assert header.round == 5 and counters.bulk_connections - before == 2 * streams
    # The same bytes as an island that opens connections for every call.
    srv2 = start_server(exact_config(run_id="t", sync_every=1), tmp_path / "fresh")
    srv2.server.servicer.bulk_keep_seconds = 0  # Join says it keeps none
    gen = torch.Generator().manual_seed(12)
    b = raw_island(srv2.address, "a", BIG, bulk_streams=streams)
    assert b.join().bulk_keep_seconds == 0
    b.push({k: torch.randn(s, generator=gen) for k, s in BIG.items()}, round_=0, kind=pb.PUSH_KIND_INIT)
    for r in range(4):
        b.push({k: torch.randn(s, generator=gen) for k, s in BIG.items()}, round_=r, tokens=3)
        assert [bytes(p) for _, p in b.pull(have_round=r)[1]] == pulled[r]
    assert srv2.server.counters.bulk_kept_calls == 0 and b.client.kept.idle(b.client.bulk) == 0


def test_connections_given_back_after_the_island_closed_are_closed_not_kept():
    """A call still running when the island closes (an abandoned exchange's pull) gives its connection
    back after ``close()``: it is closed then, not kept where nothing would ever close it."""
    from atoll.islands._transport.kept import KeptConnections

    kept = KeptConnections()
    a, b = socket.socketpair()
    c, d = socket.socketpair()
    kept.give("port", [a])
    kept.close()
    assert a.fileno() == -1  # the idle one
    kept.give("port", [c])  # the late one
    assert c.fileno() == -1 and kept.idle("port") == 0
    b.close()
    d.close()


@pytest.mark.parametrize("offset", [2**63, 10**12, 1])
def test_a_resume_offset_past_the_answer_is_refused_before_anything_is_counted(start_server, raw_island, offset):
    """Hardening round 5, item 11: a bogus resume_offset drove atoll_bytes_out_total to -2.77e19."""
    srv = start_server(exact_config(run_id="t", sync_every=1))
    a = raw_island(srv.address, "a", {"w": (4, 3)}, bulk_streams=1)
    a.join()
    a.push({"w": torch.randn(4, 3)}, round_=0, kind=pb.PUSH_KIND_INIT)
    a.push({"w": torch.randn(4, 3)}, round_=0, tokens=3)
    total = sum(len(p) for _, p in a.pull(have_round=0)[1])
    before = srv.server.counters.bytes_out
    request = pb.PullRequest(run_id="t", island_id="a", have_round=0, wait_seconds=5, resume_offset=total + offset)
    with pytest.raises(grpc.RpcError) as info:
        a.client.pull(request)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert reason_of(info.value) is Reason.BAD_REQUEST and "past the answer's" in info.value.details()
    counters = srv.server.counters
    assert counters.bytes_out >= before >= 0 and counters.bulk_pull_resumes == 0


def test_bytes_sent_again_are_counted_by_cause(start_server, raw_island, tmp_path):
    """A pull answered again with what the same rank had (an island that pulls twice) counts as sent
    again, another rank's copy does not; a push cut on the bulk port whose retry never comes counts what
    came of it once the coordinator lets it go."""
    from atoll.islands._transport.opening import open_call

    srv = start_server(exact_config(run_id="t", sync_every=1), network=NetworkOptions(stream_idle_seconds=0.5))
    gen = torch.Generator().manual_seed(5)
    a = raw_island(srv.address, "a", BIG, bulk_streams=1)
    a.join()
    a.push({k: torch.randn(s, generator=gen) for k, s in BIG.items()}, round_=0, kind=pb.PUSH_KIND_INIT)
    a.push({k: torch.randn(s, generator=gen) for k, s in BIG.items()}, round_=0, tokens=3)
    counters = srv.server.counters
    size = sum(len(p) for _, p in a.pull(have_round=0)[1])
    a.pull(have_round=0, rank=1)  # another rank's own copy
    assert counters.resent_bytes["pull_again"] == 0
    a.pull(have_round=0)
    assert counters.resent_bytes["pull_again"] == size
    # A push admitted, striped over two connections: its first unit (1 MiB) sent, then both closed (each
    # after all it sent is read: a FIN, not a reset); no retry comes: parked, then let go.
    h = pb.PushHeader(run_id="t", island_id="a", round=1, kind=pb.PUSH_KIND_DELTA, num_ranks=1, tokens=3)
    h.codec = "identity"
    h.entries.add(name="w", num_bytes=4 * (1 << 20) + 64)
    socks, _ = open_call(a.client.bulk, bulk.PUSH, "", pb.PushChunk(header=h).SerializeToString(), 10, 2)
    assert bulk.read_frame(socks[0], 1 << 20)[0] == bulk.CONTINUE
    socks[0].sendall(bulk.UNIT.pack(0, 1 << 20) + bytes(1 << 20))
    for sock in socks:
        sock.close()
    wait_for(lambda: counters.resent_bytes["push_cut"] > 0, timeout=10, what="the parked push let go")
    assert counters.resent_bytes["push_cut"] == 1 << 20
    assert counters.resent_bytes["push_unread"] == counters.resent_bytes["push_duplicate"] == 0


def test_an_eager_pushs_data_read_into_nothing_is_counted_to_the_byte(start_server, raw_island):
    """An eager push refused at its header whose data all came anyway (a client that sent it before it
    read anything): every byte the coordinator read into nothing is counted as sent for nothing."""
    from atoll.islands._transport.opening import open_call

    srv = start_server(exact_config(run_id="t", sync_every=1))
    a = raw_island(srv.address, "a", SHAPES)
    a.join()  # (for the bulk port's address)
    port = a.client.bulk
    data = bytes(3 << 20)
    h = pb.PushHeader(run_id="t", island_id="nobody", round=0, kind=pb.PUSH_KIND_DELTA, num_ranks=1)
    h.codec = "identity"
    h.entries.add(name="w", num_bytes=len(data))
    (sock,), _ = open_call(port, bulk.PUSH, "", pb.PushChunk(header=h).SerializeToString(), 10, 1, eager=True)
    with sock:
        sock.sendall(data)
        sock.shutdown(socket.SHUT_WR)
        kind, answer = bulk.read_frame(sock, 1 << 20)
    assert kind == bulk.STATUS and reason_of(bulk.BulkError.from_status(answer)) is Reason.NOT_JOINED
    counters = srv.server.counters
    wait_for(lambda: counters.resent_bytes["push_unread"] == len(data), timeout=10, what="the data read and counted")
