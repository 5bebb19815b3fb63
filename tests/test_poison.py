"""No single island can make θ non-finite, take over the round's mean with a header field, or take the
operator's view down with a reported figure: each is refused with a reason (and changes no state),
or bounded, and θ is checked finite before it is sealed."""

from __future__ import annotations

import math

import grpc
import pytest
import torch
from conftest import exact_config

from atoll.coordinator import RunConfig, checks
from atoll.coordinator.persistence import load
from atoll.protos import coordinator_pb2 as pb
from atoll.protos.reasons import Reason
from atoll.protos.status import reason_of

SHAPES = {"w": (4, 3), "b": (5,)}


def filled(value: float) -> dict[str, torch.Tensor]:
    return {k: torch.full(s, value) for k, s in SHAPES.items()}


def theta(srv) -> dict[str, torch.Tensor]:
    return srv.inspect(lambda s: {k: v.clone() for k, v in s.model.params.items()})


def bootstrapped(start_server, raw_island, config: RunConfig, codec: str = "identity"):
    srv = start_server(config)
    a = raw_island(srv.address, "a", SHAPES, codec=codec)
    b = raw_island(srv.address, "b", SHAPES, codec=codec)
    a.join()
    b.join()
    a.push(filled(1.0), round_=0, kind=pb.PUSH_KIND_INIT)
    return srv, a, b


@pytest.mark.parametrize("codec", ["identity", "int8"])
def test_finite_values_whose_weighted_sum_overflows_are_refused(start_server, raw_island, tmp_path, codec):
    """Quorum 2; a pushes +0.01 with 1000 tokens, b pushes 3e38 in every element with 1000 tokens
    (finite, within the token bound). b is refused (DELTA_TOO_LARGE) before anything is added; once
    b pushes a sane delta the round closes, θ is finite and is the exact mean; the coordinator
    restarts on its own state."""
    config = RunConfig(run_id="t", sync_every=1, quorum=2, codec=codec, downlink_codec="identity")
    srv, a, b = bootstrapped(start_server, raw_island, config, codec)
    assert a.push(filled(0.01), round_=0, tokens=1000).committed
    with pytest.raises(grpc.RpcError) as info:
        b.push(filled(3e38), round_=0, tokens=1000)
    assert reason_of(info.value) is Reason.DELTA_TOO_LARGE
    assert "norm" in info.value.details()
    assert srv.inspect(lambda s: s.accumulator.committed_islands()) == ["a"]
    assert srv.server.counters.pushes_refused == 1
    assert b.push(filled(0.03), round_=0, tokens=1000).committed
    header, _ = a.pull(0)
    assert header.round == 1
    got = theta(srv)
    assert all(bool(torch.isfinite(t).all()) for t in got.values())
    mean = torch.tensor((0.01 + 0.03) / 2)  # lr 0.7, Nesterov 0.9 on the first step: u = -0.7 * 1.9 * mean
    assert torch.allclose(got["w"], 1.0 - 0.7 * 1.9 * mean, atol=1e-3)
    srv.stop()
    snap = load(tmp_path / "state")
    assert snap.round == 1 and all(bool(torch.isfinite(t).all()) for t in snap.params.values())


def test_a_push_that_would_take_the_rounds_sum_past_its_bound_is_refused(start_server, raw_island):
    """Each tensor within the norm limit, but tokens x values past what the fp32 sum can hold with
    room to spare: refused by the round's running bound, with nothing added."""
    config = exact_config(run_id="t", sync_every=1, quorum=2, max_tokens_per_round=2**62)
    srv, a, b = bootstrapped(start_server, raw_island, config)
    big = checks.MAX_TENSOR_NORM / 8  # each tensor's norm is below the limit
    assert a.push(filled(0.01), round_=0, tokens=10).committed
    with pytest.raises(grpc.RpcError) as info:
        b.push(filled(big), round_=0, tokens=2**62)
    assert reason_of(info.value) is Reason.DELTA_TOO_LARGE
    assert "sum" in info.value.details()
    assert srv.inspect(lambda s: s.accumulator.committed_islands()) == ["a"]


def test_theta_is_checked_finite_before_it_is_sealed(start_server, raw_island, tmp_path, monkeypatch):
    """With the admission bounds taken away, an overflowing round reaches the outer step: its θ is
    found non-finite before it is sealed, nothing of it is saved or published, the coordinator stops
    (its supervisor restarts it) and a restart finds the last good round."""
    monkeypatch.setattr(checks, "MAX_TENSOR_NORM", math.inf)
    from atoll.coordinator import accumulator

    monkeypatch.setattr(accumulator, "SUM_LIMIT", math.inf)
    config = exact_config(run_id="t", sync_every=1, quorum=2)
    srv, a, b = bootstrapped(start_server, raw_island, config)
    assert a.push(filled(3e38), round_=0, tokens=1000).committed
    assert b.push(filled(3e38), round_=0, tokens=1000).committed
    srv.call(_wait_failed(srv.server))
    assert "not finite" in str(srv.server.failed.exception())
    assert srv.inspect(lambda s: s.round) == 0
    assert not (tmp_path / "state" / "log").exists() or not list((tmp_path / "state" / "log").glob("round-*"))
    srv.stop()
    snap = load(tmp_path / "state")
    assert snap.round == 0 and all(bool((t == 1.0).all()) for t in snap.params.values())


async def _wait_failed(server) -> None:
    import asyncio

    await asyncio.wait({server.failed}, timeout=20)
