"""Late pushes: dropped, or folded into the next round once with a staleness weight."""

import logging

import numpy as np
import pytest
import torch
from support import exact_config

from atoll.protos import coordinator_pb2 as pb

SHAPES = {"w": (3, 4)}


def setup(start_server, raw_island, policy):
    srv = start_server(
        exact_config(
            run_id="t",
            sync_every=1,
            quorum=1,
            outer_lr=1.0,
            outer_momentum=0.0,
            late_policy=policy,
            staleness_weight=0.5,
            max_staleness=1,
            round_deadline_seconds=0.2,
        )
    )
    a, b = raw_island(srv.address, "a", SHAPES), raw_island(srv.address, "b", SHAPES)
    a.join()
    b.join()
    theta0 = {"w": torch.randn(3, 4)}
    a.push(theta0, round_=0, kind=pb.PUSH_KIND_INIT)
    return srv, a, b, theta0


def close_round_0_without_b(srv, a):
    d_a = {"w": torch.randn(3, 4)}
    a.push(d_a, round_=0, tokens=100)
    header, _ = a.pull(0)  # closes at the 0.2 s deadline (b is live but missing)
    record = srv.inspect(lambda s: dict(s.history[-1]))
    assert header.round == 1 and record["islands"] == ["a"]
    # the phases of closing a round, as benchmarks/scale.py prints them
    assert all(0 <= record[k] < 10 for k in ("outer_step_seconds", "persist_seconds", "publish_seconds"))
    return d_a


def test_drop_policy_refuses_late_push(start_server, raw_island, caplog):
    """A delta too stale to fold adds nothing, and its work is not lost (the island carries it into its
    next push): counted as carried, not dropped, and said in one INFO line per island, not a warning
    per push (a new user saw "too stale ... dropped" 66 times for work that was carried)."""
    srv, a, b, _ = setup(start_server, raw_island, "drop")
    close_round_0_without_b(srv, a)
    with caplog.at_level(logging.DEBUG, logger="atoll.coordinator"):
        resp = b.push({"w": torch.randn(3, 4)}, round_=0, tokens=100)
        assert resp.outcome == pb.PUSH_OUTCOME_ROUND_CLOSED and not resp.committed
        a.push({"w": torch.randn(3, 4)}, round_=1, tokens=100)
        a.pull(1)
        assert b.push({"w": torch.randn(3, 4)}, round_=1, tokens=100).outcome == pb.PUSH_OUTCOME_ROUND_CLOSED
    said = [r for r in caplog.records if "too stale to fold" in r.getMessage()]
    assert [r.levelno for r in said] == [logging.INFO, logging.DEBUG]
    assert "carries its work into its next push" in said[0].getMessage() and "dropped" not in said[0].getMessage()
    counters = srv.server.counters
    assert (counters.pushes_carried, counters.pushes_late_dropped) == (2, 0)


def test_fold_applies_a_late_delta_once_with_staleness_weight(start_server, raw_island):
    srv, a, b, theta0 = setup(start_server, raw_island, "fold")
    d_a0 = close_round_0_without_b(srv, a)
    d_b_late = {"w": torch.randn(3, 4)}
    resp = b.push(d_b_late, round_=0, tokens=100)  # late by one round: folded into round 1
    assert resp.committed and not resp.duplicate and resp.outcome == pb.PUSH_OUTCOME_FOLDED
    again = b.push(d_b_late, round_=0, tokens=100)  # a retry of the same push changes nothing
    assert again.duplicate and again.committed
    acc_before = srv.inspect(lambda s: s.accumulator.sum_of("w").clone())
    d_a1 = {"w": torch.randn(3, 4)}
    a.push(d_a1, round_=1, tokens=100)
    b.pull(0)  # catch b up (round 0 -> 1), then wait for round 1 to close
    header, _ = a.pull(1)
    assert header.round == 2
    hist = srv.inspect(lambda s: s.history)
    assert hist[1]["islands"] == ["a"] and hist[1]["late"] == [["b", 0]]
    # lr 1, no momentum: θ2 = θ1 - (100 Δa1 + 0.5*100 Δb_late) / 150, θ1 = θ0 - Δa0
    theta1 = theta0["w"] - d_a0["w"]
    expected = theta1 - (100 * d_a1["w"] + 50 * d_b_late["w"]) / 150
    np.testing.assert_allclose(srv.inspect(lambda s: s.model.params["w"].clone()).numpy(), expected.numpy(), atol=1e-6)
    assert torch.allclose(acc_before, 50 * d_b_late["w"])
    # Two rounds later the same push (a restarted island's) is still answered as counted, not applied again.
    assert b.push(d_b_late, round_=0, tokens=100).outcome == pb.PUSH_OUTCOME_DUPLICATE


@pytest.mark.parametrize("behind", [1, 3, 5])
def test_a_lagging_island_gets_the_cheaper_of_the_deltas_and_theta(start_server, raw_island, tmp_path, behind):
    """An island k rounds behind catches up by k exact deltas while they weigh less than one full θ,
    else it gets θ itself: never more than one θ's bytes (int8 updates of 16K parameters: 16.5 KB each
    against θ's 64 KB, so deltas up to 3 behind). Either way it ends on the coordinator's θ, bitwise.
    (Before: up to 8 deltas, twice θ's bytes.)"""
    from atoll.compression import get_codec

    shapes = {"w": (256, 64)}
    config = exact_config(
        run_id="t", sync_every=1, quorum=1, outer_lr=1.0, outer_momentum=0.0, downlink_codec="int8",
        round_deadline_seconds=0.2,
    )  # fmt: skip
    srv = start_server(config, tmp_path)
    a, b = raw_island(srv.address, "a", shapes), raw_island(srv.address, "b", shapes)
    a.join()
    b.join()
    theta0 = {"w": torch.randn(256, 64)}
    a.push(theta0, round_=0, kind=pb.PUSH_KIND_INIT)
    for r in range(behind):
        a.push({"w": torch.randn(256, 64) * 1e-2}, round_=r, tokens=10)
        a.pull(r)
    theta, have, pulled = theta0["w"].clone(), 0, 0
    full = get_codec("identity").encoded_size((256, 64))
    delta = get_codec("int8").encoded_size((256, 64))
    while have < behind:
        header, payloads = b.pull(have)
        assert payloads, header
        pulled += len(payloads[0][1])
        value = get_codec(header.codec).decode(payloads[0][1], (256, 64))
        theta = value if header.kind == pb.UPDATE_KIND_FULL else theta + value
        have = header.round
    assert pulled == (behind * delta if behind * delta <= full else full) and pulled <= full
    assert torch.equal(theta, srv.inspect(lambda s: s.model.params["w"].clone()))


def test_an_island_whose_deltas_are_folded_is_reported_as_taking_part(start_server, raw_island):
    """Hardening round 5, item 19: a slow island showed rounds 0 and state late for the whole run though
    its pushes went into θ (folded), and /api/status dropped its goodput once it left."""
    from atoll.coordinator.transport.admin import status_json  # (what /api/status serves)

    srv, a, b, _ = setup(start_server, raw_island, "fold")
    close_round_0_without_b(srv, a)
    assert b.push({"w": torch.randn(3, 4)}, round_=0, tokens=100).outcome == pb.PUSH_OUTCOME_FOLDED
    a.push({"w": torch.randn(3, 4)}, round_=1, tokens=100)
    a.pull(1)  # round 1 closes with b's delta folded in
    row = srv.inspect(lambda s: {r["island"]: r for r in status_json(srv.server, 0.0)["islands"]})["b"]
    assert row["rounds_committed"] == 1 and row["state"] == "active" and row["tokens_into_theta"] == 100
    b.client.leave(pb.LeaveRequest(run_id="t", island_id="b"))
    row = srv.inspect(lambda s: {r["island"]: r for r in status_json(srv.server, 0.0)["islands"]})["b"]
    assert row["state"] == "left" and row["rounds_committed"] == 1
    assert row["tokens_into_theta"] == 100 and row["goodput"] is not None
