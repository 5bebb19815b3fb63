"""Every RPC driven with malformed messages: the server keeps serving and θ/round state never changes."""

import grpc
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support import exact_config

from atoll.protos import coordinator_pb2 as pb

SHAPES = {"w": (4, 3), "b": (5,)}
text = st.one_of(st.just("t"), st.just("a"), st.text(max_size=20), st.text(min_size=120, max_size=200))
ints = st.one_of(st.integers(-5, 10), st.integers(-(2**62), 2**62))
floats = st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.floats(0, 0.05))


def entries(draw_list):
    return st.lists(
        st.builds(
            lambda name, offs, sizes, n: pb.TensorEntry(name=name, offsets=offs, sizes=sizes, num_bytes=n),
            st.sampled_from(["w", "b", "zz", ""]),
            st.lists(ints, max_size=3),
            st.lists(ints, max_size=3),
            st.integers(0, 2**64 - 1),
        ),
        max_size=4,
    )


joins = st.builds(
    lambda run, island, codecs, shapes, dtype, ranks: pb.JoinRequest(
        run_id=run,
        island_id=island,
        codecs=codecs,
        num_ranks=ranks,
        tensors=[pb.TensorSpec(name=n, shape=s, dtype=dtype) for n, s in shapes],
    ),
    text,
    text,
    st.lists(st.sampled_from(["identity", "int8", "nope", ""]), max_size=3),
    st.lists(st.tuples(st.sampled_from(["w", "b", "x"]), st.lists(ints, max_size=3)), max_size=3),
    st.integers(-3, 10),
    st.integers(-3, 70000),
)
pushes = st.builds(
    lambda run, island, rnd, kind, rank, nr, tokens, codec, ents, loss, data: (
        pb.PushHeader(
            run_id=run,
            island_id=island,
            round=rnd,
            kind=kind,
            rank=rank,
            num_ranks=nr,
            tokens=tokens,
            codec=codec,
            entries=ents,
            loss=loss,
        ),
        data,
    ),
    text,
    st.sampled_from(["a", "b", "ghost"]),
    ints,
    st.integers(-2, 4),
    st.integers(-3, 3),
    st.integers(-3, 3),
    st.integers(0, 2**64 - 1),
    st.sampled_from(["identity", "int8", "x"]),
    entries(None),
    floats,
    st.lists(st.binary(max_size=300), max_size=3),
)
pulls = st.builds(
    lambda run, island, have, wait, ents: pb.PullRequest(
        run_id=run, island_id=island, have_round=have, wait_seconds=wait, regions=ents
    ),
    text,
    st.sampled_from(["a", "b", "ghost"]),
    ints,
    floats,
    entries(None),
)
heartbeats = st.builds(
    lambda run, island, rnd: pb.HeartbeatRequest(run_id=run, island_id=island, round=rnd), text, text, ints
)
leaves = st.builds(
    lambda run, island: pb.LeaveRequest(run_id=run, island_id=island), text, st.sampled_from(["ghost", "", "x" * 200])
)


def fingerprint(s):
    return (
        s.round,
        sorted(s.accumulator.committed),
        {k: v.clone() for k, v in s.model.params.items()},
        {k: s.accumulator.sum_of(k).clone() for k in s.model.specs},
        len(s.history),
    )


def same(a, b):
    return (
        a[0] == b[0]
        and a[1] == b[1]
        and a[4] == b[4]
        and all(torch.equal(x[k], y[k]) for x, y in ((a[2], b[2]), (a[3], b[3])) for k in x)
    )


def test_malformed_messages_on_every_rpc(start_server, raw_island):
    srv = start_server(exact_config(run_id="t", sync_every=1, quorum=2))
    a, b = raw_island(srv.address, "a", SHAPES), raw_island(srv.address, "b", SHAPES)
    a.join()
    b.join()
    a.push({k: torch.randn(s) for k, s in SHAPES.items()}, round_=0, kind=pb.PUSH_KIND_INIT)
    stub_client = a.client
    before = srv.inspect(fingerprint)
    codes = set()

    def call(fn):
        try:
            fn()
        except grpc.RpcError as err:
            codes.add(err.code())
            assert err.code() != grpc.StatusCode.UNKNOWN, err.details()  # no unhandled server exception
            assert err.details()

    # derandomize: the same 150 messages every run, so the refusal codes seen below are those of a known set
    # (random draws once held no INVALID_ARGUMENT: the test failed on chance, not on the server)
    @settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
    @given(
        st.one_of(
            joins.map(lambda m: ("join", m)),
            pushes.map(lambda m: ("push", m)),
            pulls.map(lambda m: ("pull", m)),
            heartbeats.map(lambda m: ("hb", m)),
            leaves.map(lambda m: ("leave", m)),
        )
    )
    def drive(item):
        kind, msg = item
        stub = stub_client._stub
        if kind == "join":
            if msg.island_id in ("a", "b"):
                return  # re-joining a live island legitimately resets its staged data
            call(lambda: stub.Join(msg, timeout=5))
        elif kind == "push":
            header, data = msg

            def chunks():
                yield pb.PushChunk(header=header)
                for d in data:
                    yield pb.PushChunk(data=d)

            call(lambda: stub.PushDelta(chunks(), timeout=5))
        elif kind == "pull":
            call(lambda: list(stub.PullUpdate(msg, timeout=5)))
        elif kind == "hb":
            call(lambda: stub.Heartbeat(msg, timeout=5))
        else:
            call(lambda: stub.Leave(msg, timeout=5))
        assert same(srv.inspect(fingerprint), before)

    drive()
    assert {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION} <= codes
    # Still serving: a real round goes through.
    a.push({k: torch.randn(s) for k, s in SHAPES.items()}, round_=0, tokens=1)
    b.push({k: torch.randn(s) for k, s in SHAPES.items()}, round_=0, tokens=1)
    header, _ = a.pull(0)
    assert header.round == 1
