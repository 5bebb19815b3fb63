"""Entry buffers reused round after round (issue 21, item 3): a fresh mapping costs a page fault per
4 KiB, which made receiving a 124M-parameter push take 0.27 s of copying; a reused one fills at
memory speed. Reuse must never hand out memory someone still reads."""

from __future__ import annotations

import numpy as np
import torch
from conftest import exact_config

from atoll.compression import get_codec
from atoll.protos import coordinator_pb2 as pb
from atoll.protos.rpc import MAPPED_ENTRY_BYTES, BufferPool, EntryAssembler

BIG = MAPPED_ENTRY_BYTES * 2


def test_the_pool_reuses_large_buffers_up_to_its_limit():
    pool = BufferPool(limit=3 * BIG)
    a, b = pool.take(BIG), pool.take(BIG)
    assert pool.reused == 0
    pool.give(memoryview(a))
    pool.give(memoryview(b))
    pool.give(memoryview(pool.take(BIG)))  # one out, the same one back
    assert pool.held == 2 * BIG and pool.reused == 1
    pool.give(memoryview(np.empty(BIG, dtype=np.uint8)))  # fits the limit: kept
    pool.give(memoryview(np.empty(BIG, dtype=np.uint8)))  # past it: dropped
    assert pool.held == 3 * BIG
    pool.give(memoryview(np.empty(100, dtype=np.uint8)))  # small ones come from the allocator
    assert pool.held == 3 * BIG
    assert pool.take(BIG + 1).nbytes == BIG + 1 and pool.reused == 1  # sizes match exactly


def test_the_coordinators_pool_keeps_no_more_than_the_budget_says_now():
    """Its limit is the in-flight budget as it stands, raised when a joining island declares its model."""
    from atoll.coordinator.state.accumulator import RoundAccumulator

    acc = RoundAccumulator()  # the budget sized from the model
    buffers = [np.empty(BIG, dtype=np.uint8) for _ in range(3)]
    acc.budget.limit = 2 * BIG
    for buf in buffers:
        acc.buffers.give(memoryview(buf))
    assert acc.buffers.held == 2 * BIG
    acc.size_budget({"w": (BIG,)})  # a joining island's model: the budget grows (to at least 256 MiB)
    acc.buffers.give(memoryview(buffers[2]))
    assert acc.budget.limit >= 3 * BIG and acc.buffers.held == 3 * BIG


def test_an_assembler_fills_pooled_buffers_with_exactly_the_streams_bytes():
    pool = BufferPool(limit=4 * BIG)
    data = np.random.default_rng(0).integers(0, 255, 2 * BIG + 7, dtype=np.uint8)
    for _ in range(2):  # the second stream gets the first one's buffers, dirty: every byte is rewritten
        asm = EntryAssembler([BIG, BIG + 7, 0], pool)
        got = []
        for start in range(0, data.nbytes, 1 << 20):
            got += asm.feed(memoryview(data[start : start + (1 << 20)]))
        got += asm.finish()
        assert [i for i, _ in got] == [0, 1, 2]
        assert bytes(got[0][1]) == data[:BIG].tobytes() and bytes(got[1][1]) == data[BIG:].tobytes()
        for _, payload in got:
            pool.give(payload)
    assert pool.reused == 2


SHAPES = {"w": (1024, 1024), "b": (8,)}  # w: 4 MiB, above the mapped-entry size


def test_the_coordinator_reuses_push_buffers_and_islands_pull_buffers_with_exact_sums(start_server, raw_island):
    srv = start_server(exact_config(run_id="t", sync_every=1, outer_lr=1.0, outer_momentum=0.0))
    a = raw_island(srv.address, "a", SHAPES)
    a.join()
    theta = {k: torch.randn(s) for k, s in SHAPES.items()}
    a.push(theta, round_=0, kind=pb.PUSH_KIND_INIT)
    identity = get_codec("identity")
    pulled = []

    def keep(header, i, payload):  # an island applies (here: decodes, a copy) and keeps nothing else
        pulled.append(identity.decode(payload))

    for r in range(3):
        delta = {k: torch.randn(s) for k, s in SHAPES.items()}
        assert a.push(delta, round_=r, tokens=4).committed
        pulled.clear()
        header, _ = a.client.pull(
            pb.PullRequest(run_id="t", island_id="a", have_round=r, wait_seconds=10), on_entry=keep
        )
        assert header.round == r + 1
        # outer lr 1, no momentum, one island: θ_{r+1} = θ_r − Δ, exactly, from reused buffers
        theta = {k: theta[k] + identity.decode(identity.encode(-delta[k])) for k in SHAPES}
        assert torch.equal(pulled[0], -delta["w"]) and torch.equal(pulled[1], -delta["b"])
        got = srv.inspect(lambda st: {k: v.clone() for k, v in st.model.params.items()})
        assert all(torch.equal(got[k], theta[k]) for k in SHAPES)
    assert srv.inspect(lambda st: st.accumulator.buffers.reused) == 2  # rounds 1 and 2 reused round 0's
    assert a.client.buffers.reused == 2


def test_the_next_rounds_sum_takes_the_replaced_thetas_memory_unless_someone_still_holds_it(start_server, raw_island):
    """The accumulator of round r+1 is θ_r's memory, zeroed (resident pages: no faults as pushes are
    added), but never while anything still references θ_r (a pull streaming it)."""
    srv = start_server(exact_config(run_id="t", sync_every=1, outer_lr=1.0, outer_momentum=0.0))
    a = raw_island(srv.address, "a", SHAPES)
    a.join()
    a.push({k: torch.randn(s) for k, s in SHAPES.items()}, round_=0, kind=pb.PUSH_KIND_INIT)
    theta0 = srv.inspect(lambda st: st.model.params["w"].data_ptr())
    assert a.push({k: torch.ones(s) for k, s in SHAPES.items()}, round_=0, tokens=4).committed
    a.pull(0)
    assert srv.inspect(lambda st: st.accumulator.sum_of("w").data_ptr()) == theta0
    assert srv.inspect(lambda st: float(st.accumulator.sum_of("w").abs().sum())) == 0.0
    held = srv.inspect(lambda st: st.model.params["w"])  # someone still holds θ_1
    before = held.clone()
    assert a.push({k: torch.ones(s) for k, s in SHAPES.items()}, round_=1, tokens=4).committed
    a.pull(1)
    assert srv.inspect(lambda st: st.accumulator.sum_of("w").data_ptr()) != held.data_ptr()
    assert torch.equal(held, before)  # θ_1, still held, was neither zeroed nor summed into


def test_a_buffer_is_held_elsewhere_while_a_container_or_a_view_refers_to_it():
    from atoll.memory import held_elsewhere

    buf = bytearray(8)
    assert not held_elsewhere(buf)
    kept = [buf]
    assert held_elsewhere(buf)
    kept.clear()
    view = memoryview(buf)[2:]  # a stream still reading it
    assert held_elsewhere(buf)
    view.release()
    del view
    assert not held_elsewhere(buf)
