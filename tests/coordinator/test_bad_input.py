"""Bad input gets a gRPC status with a reason, and changes no state."""

from __future__ import annotations

import json
import logging

import grpc
import pytest
import torch
from support import exact_config

from atoll.coordinator import RunConfig
from atoll.coordinator.options import SecurityOptions
from atoll.protos import coordinator_pb2 as pb
from atoll.protos.reasons import Reason
from atoll.protos.status import reason_of

SHAPES = {"w": (4, 3), "b": (5,)}


def state_fingerprint(s):
    return (
        s.round,
        sorted(s.accumulator.committed),
        sorted(s.accumulator.pending),
        {k: v.clone() for k, v in s.model.params.items()},
        {k: s.accumulator.sum_of(k).clone() for k in s.model.specs},
        {k: v.clone() for k, v in s.model.optimizer.buffers.items()},
        len(s.history),
    )


def assert_same(a, b):
    assert a[:3] == b[:3] and a[6] == b[6]
    for x, y in zip(a[3:6], b[3:6], strict=True):
        assert x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)


@pytest.fixture
def run(start_server, raw_island):
    srv = start_server(exact_config(run_id="t", sync_every=1, quorum=2))
    a = raw_island(srv.address, "a", SHAPES)
    b = raw_island(srv.address, "b", SHAPES)
    a.join()
    b.join()
    a.push({k: torch.randn(s) for k, s in SHAPES.items()}, round_=0, kind=pb.PUSH_KIND_INIT)
    # a commits round 0, so a bad push from b must not close the round or touch the accumulator.
    a.push({k: torch.randn(s) for k, s in SHAPES.items()}, round_=0, tokens=10)
    return srv, a, b


def good_delta():
    return {k: torch.randn(s) for k, s in SHAPES.items()}


CASES = {
    "wrong run id": (
        lambda b: b.push(good_delta(), round_=0, run_id="other"),
        grpc.StatusCode.FAILED_PRECONDITION,
        "does not match",
    ),
    "unknown tensor": (
        lambda b: b.push({"w": torch.randn(4, 3), "nope": torch.randn(5)}, round_=0),
        grpc.StatusCode.INVALID_ARGUMENT,
        "unknown tensor 'nope'",
    ),
    "wrong shape": (
        lambda b: b.push({"w": torch.randn(3, 4), "b": torch.randn(5)}, round_=0),
        grpc.StatusCode.INVALID_ARGUMENT,
        "shape [3, 4], expected [4, 3]",
    ),
    "nan": (
        lambda b: b.push({"w": torch.full((4, 3), float("nan")), "b": torch.randn(5)}, round_=0),
        grpc.StatusCode.INVALID_ARGUMENT,
        "non-finite",
    ),
    "inf": (
        lambda b: b.push({"w": torch.randn(4, 3), "b": torch.tensor([1, 2, float("inf"), 4, 5.0])}, round_=0),
        grpc.StatusCode.INVALID_ARGUMENT,
        "non-finite",
    ),
    "missing tensor": (
        lambda b: b.push({"w": torch.randn(4, 3)}, round_=0),
        grpc.StatusCode.INVALID_ARGUMENT,
        "cover 0 of 5",
    ),
    "future round": (lambda b: b.push(good_delta(), round_=7), grpc.StatusCode.FAILED_PRECONDITION, "future"),
    "wrong codec": (
        lambda b: b.push(good_delta(), round_=0, codec="int8"),
        grpc.StatusCode.INVALID_ARGUMENT,
        "not the run's codec",
    ),
    "rank out of range": (lambda b: b.push(good_delta(), round_=0, rank=3), grpc.StatusCode.INVALID_ARGUMENT, "rank 3"),
    "unknown island": (
        lambda b: b.push(good_delta(), round_=0, island_id="ghost"),
        grpc.StatusCode.NOT_FOUND,
        "has not joined",
    ),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_push_is_refused_with_reason_and_no_state_change(run, case):
    srv, _, b = run
    fn, code, reason = CASES[case]
    before = srv.inspect(state_fingerprint)
    with pytest.raises(grpc.RpcError) as info:
        fn(b)
    assert info.value.code() == code
    assert reason in info.value.details()
    assert_same(srv.inspect(state_fingerprint), before)
    # The server keeps serving: a good push from b now closes the round.
    assert b.push(good_delta(), round_=0, tokens=10).committed
    header, _ = b.pull(0)
    assert header.kind == pb.UPDATE_KIND_DELTA and header.round == 1


def test_truncated_and_corrupt_payloads(run):
    srv, _, b = run
    before = srv.inspect(state_fingerprint)
    from atoll.compression import get_codec

    ident = get_codec("identity")
    good = [ident.encode(torch.randn(s)) for s in SHAPES.values()]
    corrupt = bytearray(good[0])
    corrupt[40] ^= 0xFF
    for payloads, declared, reason in [
        ([good[0][:-9], good[1]], [len(good[0]) - 9, len(good[1])], "truncated"),
        ([bytes(corrupt), good[1]], [len(good[0]), len(good[1])], "crc32"),
        ([good[0], good[1][:10]], [len(good[0]), len(good[1])], "ended early"),
        ([good[0], good[1] + b"xx"], [len(good[0]), len(good[1])], "more bytes"),
    ]:
        h = pb.PushHeader(run_id="t", island_id="b", round=0, kind=pb.PUSH_KIND_DELTA, num_ranks=1, codec="identity")
        for name, n in zip(SHAPES, declared, strict=True):
            h.entries.add(name=name, num_bytes=n)
        with pytest.raises(grpc.RpcError) as info:
            b.client.push(h, payloads)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value.details()
        assert reason in info.value.details()
    assert_same(srv.inspect(state_fingerprint), before)


def test_oversized_entry_is_refused_before_reading(run):
    srv, _, b = run
    h = pb.PushHeader(run_id="t", island_id="b", round=0, kind=pb.PUSH_KIND_DELTA, num_ranks=1, codec="identity")
    h.entries.add(name="w", num_bytes=10**12)
    h.entries.add(name="b", num_bytes=100)
    with pytest.raises(grpc.RpcError) as info:
        b.client.push(h, [b"x" * 100])
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "outside" in info.value.details()


def test_join_errors(start_server, raw_island):
    srv = start_server(RunConfig(run_id="t", sync_every=1, codec="int8"))
    a = raw_island(srv.address, "a", SHAPES, codec="int8")
    a.join()
    a.push({k: torch.randn(s) for k, s in SHAPES.items()}, round_=0, kind=pb.PUSH_KIND_INIT)  # θ_0 fixes the model
    cases = [
        (raw_island(srv.address, "x", SHAPES, run_id="zzz", codec="int8"), {}, "does not match"),
        (
            raw_island(srv.address, "y", SHAPES, codec="identity"),
            {"codecs": ["identity", "lz-magic"]},
            "uses codec 'int8'",
        ),
        (raw_island(srv.address, "z", {"w": (4, 4), "b": (5,)}, codec="int8"), {}, "has shape [4, 4]"),
        (raw_island(srv.address, "v", {"w": (4, 3)}, codec="int8"), {}, "missing tensors ['b']"),
    ]
    for isl, overrides, reason in cases:
        with pytest.raises(grpc.RpcError) as info:
            isl.join(**overrides)
        assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert reason in info.value.details()
    assert "lz-magic" in str(_details(cases[1][0]))
    assert srv.inspect(lambda s: sorted(s.membership.islands)) == ["a"]


def _details(isl):
    try:
        isl.join(codecs=["identity", "lz-magic"])
    except grpc.RpcError as err:
        return err.details()


def test_a_second_init_is_a_harmless_duplicate(run):
    """θ_0 exists: an INIT push (a bootstrapper retrying after a lost answer) changes nothing."""
    srv, _, b = run
    before = srv.inspect(state_fingerprint)
    resp = b.push(good_delta(), round_=0, kind=pb.PUSH_KIND_INIT)
    assert resp.outcome == pb.PUSH_OUTCOME_DUPLICATE and resp.committed
    assert_same(srv.inspect(state_fingerprint), before)


def test_duplicate_push_is_harmless(run):
    srv, a, _ = run
    before = srv.inspect(state_fingerprint)
    resp = a.push(good_delta(), round_=0, tokens=10)
    assert resp.duplicate and resp.committed
    assert_same(srv.inspect(state_fingerprint), before)


def test_error_feedback_decay_is_validated_and_sent_to_islands():
    for bad in (0.0, -1.0, 1.01, float("nan")):
        with pytest.raises(ValueError, match="error_feedback_decay"):
            RunConfig(error_feedback_decay=bad)
    from atoll.coordinator.transport.convert import config_proto

    assert config_proto(RunConfig(error_feedback_decay=0.5)).error_feedback_decay == 0.5
    assert RunConfig.from_json(RunConfig(error_feedback_decay=0.25).to_json()).error_feedback_decay == 0.25
    # A config persisted before the field existed still loads, as classic error feedback (sparse too).
    for codec in ("int8", "sparse"):
        legacy = json.loads(RunConfig(codec=codec).to_json())
        del legacy["error_feedback_decay"]
        assert RunConfig.from_json(json.dumps(legacy)).error_feedback_decay == 1.0


def test_error_feedback_decay_not_given_is_the_codecs_and_is_stored_resolved():
    """β = 0.9 for sparse pushes (over 80 rounds of H=30, β = 1 ended 10.6% above identity and 0.9
    below it: benchmarks/RESULTS.md), classic error feedback for the rest; a given β is kept, and a
    stored run keeps the β it resolved to."""
    assert RunConfig(codec="sparse").error_feedback_decay == 0.9
    assert RunConfig(codec="sparse:density=0.015625").error_feedback_decay == 0.9
    for codec in ("int8", "identity", "topk:fraction=0.01", "dcttopk:fraction=0.01"):
        assert RunConfig(codec=codec).error_feedback_decay == 1.0, codec
    assert RunConfig(codec="sparse", error_feedback_decay=1.0).error_feedback_decay == 1.0
    stored = json.loads(RunConfig(codec="sparse").to_json())
    assert stored["error_feedback_decay"] == 0.9
    from atoll.coordinator.transport.convert import config_proto

    assert config_proto(RunConfig(codec="sparse")).error_feedback_decay == pytest.approx(0.9)  # what islands get
    with pytest.raises(ValueError, match="codec: unknown codec 'nope'"):
        RunConfig(codec="nope")


def rand(shapes=SHAPES):
    return {k: torch.randn(s) for k, s in shapes.items()}


# ---- error codes --------------------------------------------------------------------------------
def test_unparseable_request_bytes_answer_invalid_argument(start_server):
    """(Before: UNKNOWN, from protobuf's DecodeError.)"""
    srv = start_server()
    with grpc.insecure_channel(srv.address) as channel:
        for method in ("Join", "Heartbeat", "Leave"):
            call = channel.unary_unary(f"/atoll.v1.Coordinator/{method}")
            with pytest.raises(grpc.RpcError) as info:
                call(b"\xff\xff\xff\xff\x0f", timeout=5)
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, method
            assert reason_of(info.value) is Reason.BAD_REQUEST
        pull = channel.unary_stream("/atoll.v1.Coordinator/PullUpdate")
        with pytest.raises(grpc.RpcError) as info:
            list(pull(b"\x0a\xff", timeout=5))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_unknown_method_without_a_token_is_unimplemented_without_a_traceback(start_server, tmp_path, caplog):
    """With --island-tokens, an unknown method called without a token. (Before: UNKNOWN, and a
    server traceback logged per call.)"""
    from atoll.coordinator.transport.security import IslandTokens

    srv = start_server(security=SecurityOptions(tokens=IslandTokens({"a": "tok-a"})))
    caplog.set_level(logging.DEBUG)
    with grpc.insecure_channel(srv.address) as channel:
        with pytest.raises(grpc.RpcError) as info:
            channel.unary_unary("/atoll.v1.Coordinator/Nope")(b"", timeout=5)
        assert info.value.code() == grpc.StatusCode.UNIMPLEMENTED
        with pytest.raises(grpc.RpcError) as info:
            channel.unary_unary("/atoll.v1.Coordinator/Join")(b"", timeout=5)
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert reason_of(info.value) is Reason.UNAUTHENTICATED
    assert not [r for r in caplog.records if r.exc_info or "Traceback" in r.getMessage()]


# ---- token weight -------------------------------------------------------------------------------
def test_absurd_token_claims_are_refused(start_server, raw_island):
    """tokens = 2^64 - 1 would take nearly all of the mean's weight. (Before: accepted.)"""
    srv = start_server(exact_config(run_id="t", sync_every=10, quorum=2))
    a, b = raw_island(srv.address, "a", SHAPES), raw_island(srv.address, "b", SHAPES)
    a.join()
    b.join()
    a.push(rand(), round_=0, kind=pb.PUSH_KIND_INIT)
    with pytest.raises(grpc.RpcError) as info:
        b.push(rand(), round_=0, tokens=2**64 - 1)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert reason_of(info.value) is Reason.TOKENS_OUT_OF_RANGE
    assert str(10 * 2**24) in info.value.details()  # the default bound: H x 2^24
    assert srv.inspect(lambda s: s.accumulator.committed_islands()) == []


def test_token_bound_is_a_run_setting(start_server, raw_island):
    srv = start_server(exact_config(run_id="t", sync_every=1, max_tokens_per_round=1000))
    a = raw_island(srv.address, "a", SHAPES)
    a.join()
    a.push(rand(), round_=0, kind=pb.PUSH_KIND_INIT)
    with pytest.raises(grpc.RpcError, match="1000"):
        a.push(rand(), round_=0, tokens=1001)
    assert a.push(rand(), round_=0, tokens=1000).committed


def test_refusals_carry_a_reason(start_server, raw_island):
    srv = start_server(exact_config(run_id="t", sync_every=1))
    ghost = raw_island(srv.address, "ghost", SHAPES)
    with pytest.raises(grpc.RpcError) as info:
        ghost.pull(-1)
    assert info.value.code() == grpc.StatusCode.NOT_FOUND and reason_of(info.value) is Reason.NOT_JOINED
    other = raw_island(srv.address, "x", SHAPES, run_id="other")
    with pytest.raises(grpc.RpcError) as info:
        other.join()
    assert reason_of(info.value) is Reason.WRONG_RUN


# ---- counters -----------------------------------------------------------------------------------
def test_a_norm_bound_refusal_is_counted_once(start_server, raw_island):
    srv = start_server(exact_config(run_id="t", sync_every=1, max_delta_norm=1.0))
    a = raw_island(srv.address, "a", SHAPES)
    a.join()
    a.push(rand(), round_=0, kind=pb.PUSH_KIND_INIT)
    with pytest.raises(grpc.RpcError) as info:
        a.push({k: v * 100 for k, v in rand().items()}, round_=0, tokens=1)
    assert reason_of(info.value) is Reason.DELTA_TOO_LARGE
    assert srv.server.counters.pushes_refused == 1


def test_a_model_card_that_is_not_a_small_json_object_is_refused():
    from atoll.coordinator.errors import RequestError
    from atoll.coordinator.run.checks import model_card

    model_card("")
    model_card('{"format": "hf"}')
    huge = '{"a": "' + "x" * (64 << 10) + '"}'
    for bad, why in [("x" * 10, "not JSON"), ("[1]", "not a JSON object"), (huge, "more than")]:
        with pytest.raises(RequestError, match=why):
            model_card(bad)


def test_a_push_of_no_work_weighs_nothing(start_server, raw_island):
    """Hardening round 5, item 13: a push reporting 0 tokens and 0 inner steps weighed 1 (as much as a
    token). It weighs 0: beside a = 10 tokens, θ_1 = θ_0 - Δa (lr 1, no momentum); a round of no work
    at all leaves θ as it was (a zero mean, not 0/0)."""
    import numpy as np

    srv = start_server(exact_config(run_id="t", sync_every=1, quorum=2, outer_lr=1.0, outer_momentum=0.0))
    a, b = raw_island(srv.address, "a", SHAPES), raw_island(srv.address, "b", SHAPES)
    a.join()
    b.join()
    theta0 = {k: torch.randn(s) for k, s in SHAPES.items()}
    a.push(theta0, round_=0, kind=pb.PUSH_KIND_INIT)
    d_a, d_b = good_delta(), good_delta()
    a.push(d_a, round_=0, tokens=10)
    b.push(d_b, round_=0, tokens=0, inner_steps=0)
    a.pull(0)
    got = srv.inspect(lambda s: {k: v.clone() for k, v in s.model.params.items()})
    for k in SHAPES:
        np.testing.assert_allclose(got[k].numpy(), (theta0[k] - d_a[k]).numpy(), atol=1e-6)
    a.push(good_delta(), round_=1, tokens=0, inner_steps=0)
    b.push(good_delta(), round_=1, tokens=0, inner_steps=0)
    a.pull(1)
    after = srv.inspect(lambda s: (s.round, {k: v.clone() for k, v in s.model.params.items()}))
    assert after[0] == 2 and all(torch.equal(after[1][k], got[k]) for k in SHAPES)
