"""Entry buffers reused round after round: a fresh mapping costs a page fault per
4 KiB, which made receiving a 124M-parameter push take 0.27 s of copying; a reused one fills at
memory speed. Reuse must never hand out memory someone still reads."""

from __future__ import annotations

import grpc
import numpy as np
import torch
from support import exact_config

from atoll.compression import get_codec
from atoll.coordinator.options import NetworkOptions
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


def test_the_next_rounds_sum_takes_the_replaced_thetas_memory_unless_someone_holds_a_lease(start_server, raw_island):
    """The accumulator of round r+1 is θ_r's memory (resident pages: no faults as pushes are added),
    but never while anyone holds a lease on it: here a view of it, which a reference count missed."""
    srv = start_server(exact_config(run_id="t", sync_every=1, outer_lr=1.0, outer_momentum=0.0))
    a = raw_island(srv.address, "a", SHAPES)
    a.join()
    a.push({k: torch.randn(s) for k, s in SHAPES.items()}, round_=0, kind=pb.PUSH_KIND_INIT)
    theta0 = srv.inspect(lambda st: st.model.params["w"].data_ptr())
    assert a.push({k: torch.ones(s) for k, s in SHAPES.items()}, round_=0, tokens=4).committed
    a.pull(0)
    assert srv.inspect(lambda st: st.accumulator.sum_of("w").data_ptr()) == theta0
    assert srv.inspect(lambda st: float(st.accumulator.sum_of("w").abs().sum())) == 0.0
    held = srv.inspect(lambda st: st.model.params["w"][:8])  # a reader of θ_1 (a view: the same memory)
    lease = srv.inspect(lambda st: st.model.leases.take(held, "a test"))
    before = held.clone()
    assert a.push({k: torch.ones(s) for k, s in SHAPES.items()}, round_=1, tokens=4).committed
    a.pull(1)
    assert srv.inspect(lambda st: st.accumulator.sum_of("w").data_ptr()) != held.data_ptr()
    assert a.push({k: torch.full(s, 5.0) for k, s in SHAPES.items()}, round_=2, tokens=4).committed
    assert torch.equal(held, before)  # θ_1, still read, was neither zeroed nor summed into
    lease.release()
    theta2 = srv.inspect(lambda st: st.model.params["w"].data_ptr())
    a.pull(2)
    assert srv.inspect(lambda st: st.accumulator.sum_of("w").data_ptr()) == theta2  # nobody reads θ_2: reused


def test_a_theta_still_streamed_to_an_island_is_never_summed_into(start_server, raw_island):
    """A full-θ pull of θ_1 that reads slowly, while round 1 closes and round 2's first push arrives:
    the next round's sum must not take θ_1's memory (the pull's lease), or the island would receive
    round 2's push instead of θ_1."""
    srv = start_server(
        exact_config(run_id="t", sync_every=1, outer_lr=1.0, outer_momentum=0.0), network=NetworkOptions(bulk_port=None)
    )
    a = raw_island(srv.address, "a", {"w": (2048, 2048)})
    a.join()
    a.push({"w": torch.randn(2048, 2048)}, round_=0, kind=pb.PUSH_KIND_INIT)
    assert a.push({"w": torch.randn(2048, 2048)}, round_=0, tokens=4).committed
    a.pull(0)
    theta1 = srv.inspect(lambda st: st.model.params["w"].clone())
    with grpc.insecure_channel(srv.address) as channel:
        pull = channel.unary_stream("/atoll.v1.Coordinator/PullUpdate")
        stream = pull(pb.PullRequest(run_id="t", island_id="a", have_round=-1).SerializeToString(), timeout=60)
        first = next(stream)  # the header; 16 MiB of θ_1 to come, read in place, slowly
        assert a.push({"w": torch.randn(2048, 2048)}, round_=1, tokens=4).committed
        a.pull(1)
        assert a.push({"w": torch.full((2048, 2048), 7.0)}, round_=2, tokens=4).committed  # into the sum
        data = b"".join(pb.PullChunk.FromString(m).data for m in stream)
    header = pb.PullChunk.FromString(first).header
    assert header.kind == pb.UPDATE_KIND_FULL and header.round == 1
    assert torch.equal(get_codec("identity").decode(data, (2048, 2048)), theta1)


def test_leases_are_on_the_memory_not_on_an_object():
    from atoll.memory import Leases

    leases = Leases()
    t = torch.zeros(16)
    lease = leases.take(t[4:8], "a view's reader")
    assert leases.held(t) and leases.holders(t.view(4, 4)) == ["a view's reader"]
    assert not leases.held(torch.zeros(16))
    lease.release()
    lease.release()  # again: nothing
    assert not leases.held(t)
    buf = bytearray(32)
    second = leases.take(memoryview(buf)[8:], "a stream")
    assert leases.held(buf) and not leases.held(bytearray(32))
    second.release()
    assert not leases.held(buf)


def test_a_push_payload_is_encoded_into_again_only_once_nobody_holds_it():
    """An island encodes its next push into its last payload's buffer, but not while a flight keeps
    that payload for a re-push (a lease), even through a view of it."""
    from atoll.islands._shard_state import Placement, ShardState
    from atoll.islands._shards import local_shards
    from atoll.memory import Leases

    model = torch.nn.Linear(64, 64, bias=False)
    (shard,) = local_shards(model, None, buffers=False)
    leases = Leases()
    state = ShardState(shard, Placement("host", torch.device("cpu")), leases)
    state.start_from_local()
    codec = get_codec("int8")
    first = state.encode(codec)
    assert state.encode(codec) is first  # nobody reads it: the same buffer
    lease = leases.take(memoryview(first)[16:], "a flight kept it for a re-push")
    second = state.encode(codec)
    assert second is not first and bytes(first) == bytes(second)
    lease.release()
    assert state.encode(codec) is second
