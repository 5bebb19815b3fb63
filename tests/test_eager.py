"""Eager updates (``DiLoCoOptions(eager_updates=True)``, ``atoll island --eager-updates``): a decoupled
island that pushed trains on from where the coordinator's outer step would put θ were its own
pseudo-gradient the round's mean (Kale et al. 2025), following the run's outer momentum from the
updates it pulls; the update that lands keeps only the progress made since the push."""

from __future__ import annotations

import pytest
import torch
from conftest import inner_step, wait_for
from small_island import H, batches, config, island

from atoll.compression import get_codec
from atoll.coordinator.state.outer import NesterovSGD
from atoll.islands._messages import OuterTerms
from atoll.islands._shard_state import Placement, ShardState
from atoll.islands._shards import local_shards
from atoll.memory import Leases

IDENT = get_codec("identity")


def shard_state(nesterov: bool = True, lr: float = 0.7, momentum: float = 0.9):
    torch.manual_seed(0)
    model = torch.nn.Linear(16, 8, bias=False)
    (shard,) = local_shards(model, None, buffers=False)
    state = ShardState(shard, Placement("host", torch.device("cpu")), Leases())
    state.start_from_local()
    state.outer = OuterTerms(lr, momentum, nesterov)
    return shard, state, NesterovSGD({"w": shard.sizes}, lr=lr, momentum=momentum, nesterov=nesterov)


@pytest.mark.parametrize("nesterov", [True, False])
def test_an_island_follows_the_outer_momentum_and_forecasts_a_round_of_its_own_delta(nesterov):
    """Over six rounds of one island: after each push θ is where the coordinator's step with that delta
    as the mean puts it (the momentum followed from the updates pulled, to float32 rounding), and the
    update that lands keeps only the progress made since the push."""
    shard, state, coordinator = shard_state(nesterov)
    gen = torch.Generator().manual_seed(1)
    theta = state.start.clone()
    for _ in range(6):
        delta = torch.randn(shard.sizes, generator=gen) * 0.01
        shard.local().data.copy_(state.start - delta)  # H inner steps
        state.take_snapshot()
        state.eager_shift()
        u = coordinator.step_("w", delta.clone())
        assert torch.allclose(shard.local(), theta + u, atol=1e-6)
        progress = torch.randn(shard.sizes, generator=gen) * 0.001
        shard.local().data.add_(progress)  # steps taken while the exchange is out
        state.apply(IDENT.encode(u), full=False)
        state.load_into_param(merge=True)
        theta = theta + u
        assert torch.allclose(shard.local(), theta + progress, atol=1e-6)
        assert torch.allclose(state.momentum, coordinator.buffers["w"], atol=1e-5)


def test_a_dropped_eager_push_carries_the_islands_progress_and_not_its_forecast():
    """A push refused as too stale (its work carried into the next push): loading the new θ keeps all
    the island's progress since its round's start, θ_new + (θ_at_push − θ_start) + progress, and none
    of the forecast's jump, which was no work of the island's."""
    shard, state, _ = shard_state()
    delta = torch.full(shard.sizes, 0.01)
    start = state.start.clone()
    shard.local().data.copy_(start - delta)
    state.take_snapshot()
    state.eager_shift()
    assert not torch.allclose(shard.local(), start - delta)  # it moved
    shard.local().data.add_(0.002)
    state.keep_base()
    u = torch.full(shard.sizes, -0.05)
    state.apply(IDENT.encode(u), full=False)
    state.load_into_param(merge=True)
    assert torch.allclose(shard.local(), start + u - delta + 0.002, atol=1e-6)


def test_a_full_theta_forgets_the_followed_momentum():
    """θ itself (a catch-up over rounds it did not see) says nothing of the momentum: the forecast
    starts again from none rather than from a stale one."""
    shard, state, _ = shard_state()
    state.apply(IDENT.encode(torch.full(shard.sizes, -0.1)), full=False)
    assert state.momentum is not None and state.momentum.abs().sum() > 0
    state.apply(IDENT.encode(torch.zeros(shard.sizes)), full=True)
    assert state.momentum is None


def test_an_eager_decoupled_island_trains_on_from_its_forecast(start_server):
    """Two islands, quorum 2, a with eager updates: once a pushes, its θ is θ_0 + the outer step of its
    own delta (no momentum yet: −lr·(1 + μ)·Δ); it trains on from there while b's push is missing, and
    when the round closes it holds θ_1 + the progress since its push, nothing of the forecast."""
    srv = start_server(config(quorum=2, outer_mode="decoupled", lease_seconds=60.0))
    a_model, a_opt, a = island(srv.address, island_id="a", eager_updates=True, align_pushes=False)
    b_model, b_opt, b = island(srv.address, island_id="b", align_pushes=False)
    a.start()
    b.start()
    try:
        data = batches(2 * H - 2)  # H, pushed, then H - 2 (the step that applies the update pushes no more)
        theta0 = {n: p.detach().clone() for n, p in a_model.named_parameters()}
        for i, batch in enumerate(data):
            loss = inner_step(a_model, a_opt, batch)
            if i == H - 1:
                delta = {n: theta0[n] - p.detach() for n, p in a_model.named_parameters()}
            assert a.step(tokens=32, loss=loss) is None
            if i == H - 1:  # pushed: θ is the forecast
                for n, p in a_model.named_parameters():
                    assert torch.allclose(p.detach(), theta0[n] - 0.7 * 1.9 * delta[n], atol=1e-6)
                forecast = {n: p.detach().clone() for n, p in a_model.named_parameters()}
        before = {n: p.detach().clone() for n, p in a_model.named_parameters()}
        for batch in data[:H]:
            b.step(tokens=32, loss=inner_step(b_model, b_opt, batch))
        wait_for(lambda: srv.inspect(lambda s: s.round) == 1)
        wait_for(lambda: not a._exchanges.in_flight()[0].thread.is_alive())
        assert a.step(tokens=0) is not None and not a._exchanges.in_flight()  # applied; no push yet
        theta1 = a.global_params()
        for n, p in a_model.named_parameters():
            assert torch.allclose(p.detach(), theta1[n] + (before[n] - forecast[n]), atol=1e-6)
    finally:
        a.close()
        b.close()
