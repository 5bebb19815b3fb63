"""Expected outcomes of pushes and pulls travel as data: a closed round, an island ahead of the
coordinator, a round without token counts."""

from __future__ import annotations

import math

import torch
from support import exact_config

from atoll.protos import coordinator_pb2 as pb

SHAPES = {"w": (4, 3), "b": (5,)}


def rand(shapes=SHAPES):
    return {k: torch.randn(s) for k, s in shapes.items()}


# ---- outcomes as data ---------------------------------------------------------------------------
def test_a_push_for_a_closed_round_is_an_outcome_not_an_error_text(start_server, raw_island):
    srv = start_server(
        exact_config(
            run_id="t",
            sync_every=1,
            quorum=1,
            round_deadline_seconds=0.2,
            late_policy="drop",
        )
    )
    a, b = raw_island(srv.address, "a", SHAPES), raw_island(srv.address, "b", SHAPES)
    a.join()
    b.join()
    a.push(rand(), round_=0, kind=pb.PUSH_KIND_INIT)
    a.push(rand(), round_=0, tokens=3)
    assert a.pull(0)[0].round == 1  # closed at the deadline without b
    resp = b.push(rand(), round_=0, tokens=3)
    assert resp.outcome == pb.PUSH_OUTCOME_ROUND_CLOSED and not resp.committed
    assert a.push(rand(), round_=1, tokens=3).outcome == pb.PUSH_OUTCOME_COMMITTED
    assert a.push(rand(), round_=1, tokens=3).outcome == pb.PUSH_OUTCOME_DUPLICATE


def test_an_island_ahead_of_the_coordinator_is_served_the_full_parameters(start_server, raw_island):
    """After an operator rolls the coordinator back, an island holding a newer round gets the full θ
    as an answer (UPDATE_KIND_FULL), not a FAILED_PRECONDITION it has to interpret."""
    srv = start_server(exact_config(run_id="t", sync_every=1))
    a = raw_island(srv.address, "a", SHAPES)
    a.join()
    theta = rand()
    a.push(theta, round_=0, kind=pb.PUSH_KIND_INIT)
    header, payloads = a.pull(5)
    assert header.kind == pb.UPDATE_KIND_FULL and header.round == 0


def test_no_nan_loss_is_reported_for_a_round_without_tokens(start_server, raw_island):
    """A round whose islands sent no token counts reports their mean loss, not 0.0."""
    srv = start_server(exact_config(run_id="t", sync_every=1))
    a = raw_island(srv.address, "a", SHAPES)
    a.join()
    a.push(rand(), round_=0, kind=pb.PUSH_KIND_INIT)
    a.push(rand(), round_=0, loss=2.5)
    header, _ = a.pull(0)
    assert math.isclose(header.loss, 2.5)
