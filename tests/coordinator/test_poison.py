"""No single island can make θ non-finite, take over the round's mean with a header field, or take the
operator's view down with a reported figure: each is refused with a reason (and changes no state),
or bounded, and θ is checked finite before it is sealed."""

from __future__ import annotations

import math

import grpc
import pytest
import torch
from support import exact_config

from atoll.coordinator import RunConfig
from atoll.coordinator.disk.snapshots import load
from atoll.coordinator.options import AdminOptions
from atoll.coordinator.run import checks
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
    from atoll.coordinator.state import accumulator

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


# ---- header fields ------------------------------------------------------------------------------
def test_inner_steps_are_bounded_like_tokens_and_a_tokenless_weight_never_passes_the_bound(start_server, raw_island):
    """inner_steps = 2^64-1 with tokens = 0 weighed steps x the others' tokens per step and took the
    mean over, even under --max-tokens-per-round 2000: now refused (TOKENS_OUT_OF_RANGE). Within the
    bound, a token-less island weighs at most the bound: θ moves by the 1000 : 2000 mean."""
    config = exact_config(
        run_id="t", sync_every=1, quorum=2, max_tokens_per_round=2000, outer_lr=1.0, outer_momentum=0.0
    )
    srv, a, b = bootstrapped(start_server, raw_island, config)
    assert a.push(filled(0.01), round_=0, tokens=1000, inner_steps=1).committed  # 1000 tokens per step
    with pytest.raises(grpc.RpcError) as info:
        b.push(filled(-1.0), round_=0, tokens=0, inner_steps=2**64 - 1)
    assert reason_of(info.value) is Reason.TOKENS_OUT_OF_RANGE and "inner_steps" in info.value.details()
    assert b.push(filled(-1.0), round_=0, tokens=0, inner_steps=2000).committed  # 2000 x 1000, capped at 2000
    header, _ = a.pull(0)
    assert header.round == 1
    mean = (1000 * 0.01 + 2000 * -1.0) / 3000
    assert torch.allclose(theta(srv)["w"], torch.tensor(1.0 - mean), atol=1e-6)


def test_a_push_for_a_round_the_island_never_held_does_not_count(start_server, raw_island):
    """At round 2 a push for round -1 (or any round before the island joined) was folded, once per
    round: one island counted five times. A round below 0 is a bad request; one before the island
    joined answers ROUND_CLOSED and adds nothing; the island's own round still commits."""
    srv = start_server(exact_config(run_id="t", sync_every=1, quorum=1, max_staleness=4))
    a = raw_island(srv.address, "a", SHAPES)
    a.join()
    a.push(filled(1.0), round_=0, kind=pb.PUSH_KIND_INIT)
    for r in range(2):
        assert a.push(filled(0.01), round_=r, tokens=10).committed
        assert a.pull(r)[0].round == r + 1
    c = raw_island(srv.address, "c", SHAPES)
    c.join()  # at round 2
    for r in (-1, -4):
        with pytest.raises(grpc.RpcError) as info:
            c.push(filled(-1.0), round_=r, tokens=10)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "round" in info.value.details()
    for r in (0, 1):
        assert c.push(filled(-1.0), round_=r, tokens=10).outcome == pb.PUSH_OUTCOME_ROUND_CLOSED
    assert srv.inspect(lambda s: (dict(s.accumulator.late), s.accumulator.committed_islands())) == ({}, [])
    assert (srv.server.counters.pushes_late_dropped, srv.server.counters.pushes_carried) == (2, 0)  # work lost
    assert c.push(filled(0.01), round_=2, tokens=10).outcome == pb.PUSH_OUTCOME_COMMITTED


def test_a_reported_loss_is_bounded_and_its_mean_cannot_overflow(start_server, raw_island):
    """loss = 1e308 with 2000 tokens overflowed the round's weighted loss to inf: /api/status answered
    500 and `atoll status` failed for as long as the record was in the history. Now such a loss is a
    bad request, and the mean of large finite ones is computed without overflow."""
    from support import http

    config = exact_config(run_id="t", sync_every=1, quorum=2, max_tokens_per_round=2**62)
    srv = start_server(config, admin=AdminOptions(port=0))
    a, b = raw_island(srv.address, "a", SHAPES), raw_island(srv.address, "b", SHAPES)
    a.join()
    b.join()
    a.push(filled(1.0), round_=0, kind=pb.PUSH_KIND_INIT)
    with pytest.raises(grpc.RpcError) as info:
        a.push(filled(0.01), round_=0, tokens=2000, loss=1e308)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "loss" in info.value.details()
    assert a.push(filled(0.01), round_=0, tokens=2**40, loss=1e29).committed
    assert b.push(filled(0.01), round_=0, tokens=2**40, loss=3e29).committed
    a.pull(0)
    assert srv.inspect(lambda s: s.history[0]["loss"]) == pytest.approx(2e29)
    code, body = http(srv.server.admin.address + "/api/status")
    assert code == 200 and json_strict(body)["history"][0]["loss"] == pytest.approx(2e29)


def test_a_non_finite_figure_never_takes_the_status_endpoints_down(start_server, raw_island, capsys):
    """A figure that is not finite (a record written by an older coordinator, say) is shown as null with
    a warning in /api/status (strict JSON, 200), left out of /metrics, and `atoll status` prints."""
    from support import http

    from atoll.cli import main

    srv = start_server(exact_config(run_id="t", sync_every=1, quorum=1), admin=AdminOptions(port=0))
    a = raw_island(srv.address, "a", SHAPES)
    a.join()
    a.push(filled(1.0), round_=0, kind=pb.PUSH_KIND_INIT)
    a.push(filled(0.01), round_=0, tokens=5, loss=2.0)
    a.pull(0)

    def poison(s) -> None:  # figures no check let through, should one ever be
        s.history[0].loss, s.history[0].seconds_open = math.inf, math.nan

    srv.inspect(poison)
    base = srv.server.admin.address
    code, body = http(base + "/api/status")
    status = json_strict(body)
    assert code == 200 and status["history"][0]["loss"] is None and status["history"][0]["seconds_open"] is None
    assert any("history[0].loss" in w for w in status["warnings"])
    code, text = http(base + "/metrics")
    assert code == 200 and "\natoll_round_loss " not in text and "Inf" not in text and "NaN" not in text
    assert main(["status", "--admin", base]) == 0
    assert "round 1" in capsys.readouterr().out


def json_strict(body: str):
    import json

    def refuse(name):
        raise ValueError(f"not strict JSON: {name}")

    return json.loads(body, parse_constant=refuse)
