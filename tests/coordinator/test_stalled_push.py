"""A push whose striped data comes out of order, twice, or never (a stalled stripe) holds up nobody else:
the other islands' round closes by its grace window, without it, and their pulls get the update then. The
out-of-order push is whole and counts; the other two do not."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from support import exact_config, wait_for

from atoll.compression import get_codec
from atoll.islands._transport.opening import open_call
from atoll.protos import bulk
from atoll.protos import coordinator_pb2 as pb

SHAPES = {"w": (3 << 18,)}
"""3 MiB and its framing: four units of a striped call's data."""
GRACE = 2.0


def striped_push(port, island: str, payload: bytes, units: list[tuple[int, int]], stall: bool) -> bytes | None:
    """A push of ``payload`` for round 0 striped over two connections, sent by hand: ``units`` are
    (connection, unit index) in the order they go (a unit listed twice goes twice); ``stall``: the second
    connection never ends its units. Returns the coordinator's answer frame (None: none came in 30 s, or
    the coordinator dropped the connections)."""
    h = pb.PushHeader(run_id="t", island_id=island, round=0, kind=pb.PUSH_KIND_DELTA, num_ranks=1, tokens=1)
    h.codec = "identity"
    h.entries.add(name="w", num_bytes=len(payload))
    socks, _ = open_call(port, bulk.PUSH, "", pb.PushChunk(header=h).SerializeToString(), 10, 2)
    try:
        kind, _ = bulk.read_frame(socks[0], 1 << 20)
        assert kind == bulk.CONTINUE
        cut = list(bulk.cut_units(0, payload))
        for conn, index in units:
            offset, unit = cut[index]
            socks[conn].sendall(bulk.UNIT.pack(offset, unit.nbytes) + bytes(unit))
        for conn, sock in enumerate(socks):
            if not (stall and conn == 1):
                sock.sendall(bulk.UNIT.pack(bulk.END, 0))
        socks[0].settimeout(30)
        kind, answer = bulk.read_frame(socks[0], 1 << 20)
        return bytes([kind]) + answer
    except (TimeoutError, OSError, bulk.BulkError):  # (BulkError: a connection ended)
        return None
    finally:
        for sock in socks:
            sock.close()


@pytest.mark.parametrize("case", ["out_of_order", "twice", "stalled"])
def test_a_bad_striped_push_holds_up_no_other_islands_pull(start_server, raw_island, case):
    srv = start_server(exact_config(run_id="t", sync_every=1, quorum=2, grace_window=str(GRACE)))
    gen = torch.Generator().manual_seed(9)
    a, b, c = (raw_island(srv.address, name, SHAPES, bulk_streams=1) for name in "abc")
    for island in (a, b, c):
        island.join()
    a.push({"w": torch.randn(SHAPES["w"], generator=gen)}, round_=0, kind=pb.PUSH_KIND_INIT)
    payload = bytes(get_codec("identity").encode(torch.randn(SHAPES["w"], generator=gen)))
    n = len(list(bulk.cut_units(0, payload)))
    assert n == 4
    units = {
        "out_of_order": [(i % 2, i) for i in reversed(range(n))],  # every unit once, the last first
        "twice": [(0, 0), (1, 0)] + [(i % 2, i) for i in range(1, n)],  # the first unit on both connections
        "stalled": [(0, 0), (1, 1)],  # the rest never comes, and the second connection never ends
    }[case]
    answered: list = []
    pusher = threading.Thread(
        target=lambda: answered.append(striped_push(c.client.bulk, "c", payload, units, stall=case == "stalled")),
        daemon=True,
    )
    pusher.start()
    wait_for(  # c's push is open (or over) before the others push
        lambda: answered or srv.inspect(lambda s: ("c", 0) in s.accumulator.streams), what="c's push opened"
    )
    started = time.monotonic()
    for island in (a, b):
        island.push({"w": torch.randn(SHAPES["w"], generator=gen)}, round_=0, tokens=1)
    header, _ = a.pull(have_round=0, wait_seconds=GRACE + 10)
    waited = time.monotonic() - started
    assert header.round == 1
    record = srv.inspect(lambda s: s.history[-1])
    if case == "out_of_order":  # whole: it counts, and nobody waited for a grace window
        assert record["islands"] == ["a", "b", "c"] and waited < GRACE
    else:  # refused, or still open: the round closed without it once its grace window was over
        assert record["islands"] == ["a", "b"] and waited < GRACE + 3
    if case == "stalled":  # (its stream is still open: the test ends it)
        assert not answered
    else:
        pusher.join(30)
        (got,) = answered
        if case == "out_of_order":
            assert got[0] == bulk.OK and pb.PushResponse.FromString(got[1:]).outcome == pb.PUSH_OUTCOME_COMMITTED
        else:  # a unit out of place: its connections dropped (its island's retry starts over)
            assert got is None
