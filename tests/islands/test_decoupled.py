"""``--outer-mode decoupled``: an island never blocks on the exchange while it can train. Its update is
applied when it arrives, keeping the local progress made since the push; its next push is relative to
the round it actually started from, and the coordinator folds it with its staleness."""

from __future__ import annotations

import pytest
import torch
from support import H, batches, config, exact_config, inner_step, island, wait_for


def test_a_decoupled_island_keeps_training_while_its_round_waits_and_keeps_that_progress(start_server):
    """Quorum 2: round 0 cannot close until b pushes. a (before: blocked in step() until then) takes
    3H more steps meanwhile; when the round closes a applies θ_1 + (θ_a − θ_a at push) at its next step,
    pushes at once (its count is long past H) and that push carries every step since the first one."""
    srv = start_server(config(quorum=2, outer_mode="decoupled", lease_seconds=60.0))
    a_model, a_opt, a = island(srv.address, island_id="a")
    # b, which lands last, would push its next round sooner (tests/coordinator/test_push_phase.py): H steps here.
    b_model, b_opt, b = island(srv.address, island_id="b", align_pushes=False)
    a.start()
    b.start()
    try:
        data = batches(4 * H)
        for i, batch in enumerate(data):
            loss = inner_step(a_model, a_opt, batch)
            if i == H - 1:
                at_push = {n: p.detach().clone() for n, p in a_model.named_parameters()}
            # Nothing applied: round 0 is still open, and step() returns without waiting for it (only
            # b's push, below, can close it).
            assert a.step(tokens=32, loss=loss) is None
        assert a.round == 0 and a.inner_steps == 4 * H and len(a._exchanges.in_flight()) == 1
        before = {n: p.detach().clone() for n, p in a_model.named_parameters()}
        for batch in data[:H]:
            b.step(tokens=32, loss=inner_step(b_model, b_opt, batch))  # b too, for its own round 0
        wait_for(lambda: srv.inspect(lambda s: s.round) == 1)
        wait_for(lambda: not a._exchanges.in_flight()[0].thread.is_alive())
        stats = a.step(tokens=0)  # applies the update (no inner step taken: the model is as before)
        assert stats is not None and stats.round == 0 and stats.sync_seconds < 1.0
        theta1 = a.global_params()
        for n, p in a_model.named_parameters():
            assert torch.allclose(p.detach(), theta1[n] + (before[n] - at_push[n]), atol=1e-6)
        # ... and pushed again at once: 3H + 1 steps since the first push, relative to θ_1 (round 1)
        (flight,) = a._exchanges.in_flight()
        assert (flight.round, flight.steps, flight.tokens) == (1, 3 * H + 1, 3 * H * 32)
        for b_batch in data[:H]:
            b.step(tokens=32, loss=inner_step(b_model, b_opt, b_batch))
        wait_for(lambda: srv.inspect(lambda s: s.round) == 2)
        record = srv.inspect(lambda s: dict(s.history[1]))
        assert record["steps_by_island"] == {"a": 3 * H + 1, "b": H}
    finally:
        a.close()
        b.close()


def test_a_slow_decoupled_island_pushes_early_and_is_folded_with_its_staleness(start_server):
    """Quorum 1: the fast island closes rounds by itself. The slow one, seeing (by its heartbeats) the run
    3 rounds past its θ, pushes at its next step rather than after H (a delta H steps later would come
    too stale to fold); the coordinator folds it with weight tokens x staleness_weight ** 3."""
    srv = start_server(
        config(quorum=1, outer_mode="decoupled", lease_seconds=60.0, grace_window="0", staleness_weight=0.5)
    )
    # (neither waits for its update after a push: each is applied at the step after it came)
    f_model, f_opt, fast = island(srv.address, island_id="fast", update_wait=0)
    s_model, s_opt, slow = island(srv.address, island_id="slow", heartbeat_seconds=0.05, update_wait=0)
    fast.start()
    slow.start()
    try:
        data = batches(H)
        for _ in range(3):  # three rounds close on the fast island alone
            r = fast.round
            for batch in data:
                fast.step(tokens=32, loss=inner_step(f_model, f_opt, batch))
            wait_for(lambda r=r: srv.inspect(lambda s: s.round) == r + 1)
            wait_for(lambda: not fast._exchanges.in_flight() or not fast._exchanges.in_flight()[0].thread.is_alive())
            fast.step(tokens=0)
        assert srv.inspect(lambda s: s.round) == 3 and slow.round == 0
        wait_for(lambda: slow.link.sessions[0].latest_round == 3)  # heard by a heartbeat
        slow.step(tokens=32, loss=inner_step(s_model, s_opt, data[0]))  # one step, and it pushes
        wait_for(lambda: srv.inspect(lambda s: ("slow", 0) in s.accumulator.late))
        record = srv.inspect(lambda s: s.accumulator.late[("slow", 0)])
        assert (record.inner_steps, record.weight) == (1, 32 * 0.5**3)
        wait_for(lambda: not slow._exchanges.in_flight()[0].thread.is_alive())
        slow.step(tokens=0)
        assert slow.round == 3 and slow.history[-1].dropped is False
    finally:
        fast.close()
        slow.close()


def two_raw_islands(start_server, raw_island, tmp_path, *, step: str, lr: float, momentum: float):
    """A decoupled run (quorum 1, exact arithmetic) of islands a and b on one (3, 4) tensor, θ_0 pushed
    by a: (config, server, a, b, θ_0)."""
    from atoll.protos import coordinator_pb2 as pb

    cfg = exact_config(
        run_id="t", sync_every=1, quorum=1, outer_mode="decoupled", decoupled_step=step, outer_lr=lr,
        outer_momentum=momentum, grace_window="0", lease_seconds=60.0,
    )  # fmt: skip
    srv = start_server(cfg, tmp_path)
    a, b = raw_island(srv.address, "a", {"w": (3, 4)}), raw_island(srv.address, "b", {"w": (3, 4)})
    a.join()
    b.join()
    theta = torch.randn(3, 4)
    a.push({"w": theta}, round_=0, kind=pb.PUSH_KIND_INIT)
    return cfg, srv, a, b, theta


@pytest.mark.parametrize("step", ["share", "full"])
def test_a_decoupled_round_of_some_islands_steps_by_its_share(start_server, raw_island, tmp_path, step):
    """Quorum 1: a round made of one island's delta moved θ as far as a round of everyone, so with N
    islands θ moved ~N times as far per unit of work, and decoupled runs ended far worse than barrier
    ones (the quality map: θ's loss 3.21 against 2.50, tiny GPT, H=10, speeds 1:1:4). With ``share`` a
    round steps by its weight over the live islands' usual weights together; ``full`` keeps the old rule.
    Exact values: lr 1, no momentum."""
    import numpy as np

    _, srv, a, b, theta = two_raw_islands(start_server, raw_island, tmp_path, step=step, lr=1.0, momentum=0.0)
    deltas = [("a", 0, 100), ("b", 1, 300), ("a", 2, 100)]  # (island, round, tokens), each closes its round
    shares = [1.0, 300 / 400, 100 / 400] if step == "share" else [1.0, 1.0, 1.0]  # b unknown in round 0
    for (who, r, tokens), share in zip(deltas, shares, strict=True):
        d = torch.randn(3, 4)
        isl = a if who == "a" else b
        assert isl.push({"w": d}, round_=r, tokens=tokens).committed
        assert isl.pull(r)[0].round == r + 1
        theta = theta - share * d
        got = srv.inspect(lambda s: s.model.params["w"].clone())
        np.testing.assert_allclose(got.numpy(), theta.numpy(), atol=1e-6)
    records = srv.inspect(lambda s: [dict(h) for h in s.history])
    if step == "share":
        assert [rec["share"] for rec in records[-3:]] == pytest.approx(shares)
    else:
        assert all("share" not in rec for rec in records)


def per_share_reference(theta, rounds, lr, mu, nesterov):
    """NumPy, float64, whole shares: each round steps by -lr*g; once the shares since the momentum last
    advanced add up to S (a whole number here), S plain momentum steps of their mean G/S are taken, one
    after the other, and their momentum parts added to that round's step."""
    import numpy as np

    theta, m, pending, s = theta.astype(np.float64), np.zeros_like(theta, np.float64), 0.0, 0.0
    out = []
    for g, share in rounds:
        pending, s = pending + g, s + share
        step = g.astype(np.float64)
        if s >= 1.0:
            assert s == int(s)
            mean = pending / s
            for _ in range(int(s)):
                if nesterov:
                    m = mu * m + mean
                    step = step + mu * m
                else:
                    step = step + mu * m
                    m = mu * m + mean
            pending, s = 0.0, 0.0
        theta = theta - lr * step
        out.append(theta)
    return out


def delayed_nesterov_reference(theta, rounds, lr, mu):
    """NumPy's Delayed Nesterov (float64): each round (g, share) steps by -lr*g; once the shares since
    the momentum last advanced add up to 1, m <- mu*m + G/S and that round steps by -lr*(g + mu*m)."""
    import numpy as np

    theta, m, pending, s = theta.astype(np.float64), np.zeros_like(theta, np.float64), 0.0, 0.0
    out = []
    for g, share in rounds:
        pending, s = pending + g, s + share
        if s >= 1.0 - 1e-9:
            m = mu * m + pending / s
            theta = theta - lr * (g + mu * m)
            pending, s = 0.0, 0.0
        else:
            theta = theta - lr * g
        out.append(theta)
    return out


def test_delayed_nesterov_applies_the_momentum_once_per_full_rounds_share():
    """The optimizer alone against NumPy, whole tensors and a chunk at a time (the outer step's way);
    with every round full it is Nesterov SGD bit for bit; its pending state survives state_tensors."""
    import numpy as np

    from atoll.coordinator.state.delayed import DelayedNesterov
    from atoll.coordinator.state.outer import NesterovSGD

    gen = torch.Generator().manual_seed(2)
    theta0 = torch.randn(1000, generator=gen)
    shares = [1.0, 0.25, 0.5, 0.25, 0.75, 0.5, 1.0]
    grads = [torch.randn(1000, generator=gen) * s for s in shares]  # (a round's gradient is share-scaled)
    rounds = [(g.numpy(), s) for g, s in zip(grads, shares, strict=True)]
    want = delayed_nesterov_reference(theta0.numpy(), rounds, 0.7, 0.9)
    for chunk in (None, 300):
        opt = DelayedNesterov({"w": (1000,)}, lr=0.7, momentum=0.9, nesterov=True)
        theta = theta0.clone()
        for r, (g, share) in enumerate(zip(grads, shares, strict=True)):
            opt.begin_round(share)
            u = g.clone()
            if chunk is None:
                opt.step_("w", u)
            else:
                for start in range(0, 1000, chunk):
                    opt.step_("w", u.narrow(0, start, min(chunk, 1000 - start)), start)
            opt.end_round()
            theta += u
            np.testing.assert_allclose(theta.numpy(), want[r], rtol=1e-5, atol=1e-5)
        if chunk is None:  # rounds 5 and 6: 0.5 pending, then a full round closes it
            assert opt.pending_share == 0.0
            saved = {k: v.clone() for k, v in opt.state_tensors().items()}
    # Rounds holding more than a full round's work (the ``progress`` rule): S full
    # rounds' shares since the momentum last advanced step as S Nesterov (heavy-ball) steps of G / S.
    long = [(torch.randn(1000, generator=gen), s) for s in (0.5, 2.5, 2.0, 0.25, 0.75)]
    for nesterov in (True, False):
        want = per_share_reference(theta0.numpy(), [(g.numpy(), s) for g, s in long], 0.7, 0.9, nesterov)
        over = DelayedNesterov({"w": (1000,)}, lr=0.7, momentum=0.9, nesterov=nesterov, advance="progress")
        theta = theta0.clone()
        for r, (g, share) in enumerate(long):
            over.begin_round(share)
            for start in range(0, 1000, 300):
                theta.narrow(0, start, min(300, 1000 - start)).add_(
                    over.step_("w", g.narrow(0, start, min(300, 1000 - start)).clone(), start)
                )
            over.end_round()
            np.testing.assert_allclose(theta.numpy(), want[r], rtol=1e-5, atol=1e-5, err_msg=f"round {r}")
    again = DelayedNesterov({"w": (1000,)}, lr=0.7, momentum=0.9, nesterov=True)
    again.begin_round(0.25)
    again.end_round()
    again.load_state_tensors(saved)
    assert again.pending_share == 0.0 and torch.equal(again.buffers["w"], opt.buffers["w"])
    # Every round full: Nesterov SGD, the same bits; SGD with momentum (heavy ball) without Nesterov.
    for nesterov in (True, False):
        dn, plain = (k({"w": (1000,)}, lr=0.7, momentum=0.9, nesterov=nesterov) for k in (DelayedNesterov, NesterovSGD))
        for g in grads:
            dn.begin_round(1.0)
            a, b = dn.step_("w", g.clone()), plain.step_("w", g.clone())
            dn.end_round()
            assert torch.equal(a, b) if nesterov else torch.allclose(a, b, rtol=1e-6, atol=1e-7)


def nesterov_reference(theta, grads, lr, mu, nesterov, m=None):
    """NumPy (float64), one full round per gradient: Nesterov SGD (heavy ball without ``nesterov``),
    test_outer_step's reference with one island a round, from momentum ``m`` (0); (θ after each round,
    the momentum at the end)."""
    import numpy as np
    from support.reference import numpy_outer_sgd

    theta, out = {"w": theta.astype(np.float64)}, []
    m = {"w": np.zeros_like(theta["w"]) if m is None else m.astype(np.float64)}
    for g in grads:
        theta, m = numpy_outer_sgd(theta, m, [{"w": g}], [1], lr=lr, mu=mu, nesterov=nesterov)
        out.append(theta["w"])
    return out, m["w"]


def test_the_even_rule_steps_rounds_of_some_islands_as_their_share_of_whole_rounds():
    """``even``: every round advances the momentum as its share's worth of full rounds, whatever the
    share (``progress`` held it back until the shares added up to one, then stepped it in one go: a
    round with the momentum moved θ ~3x as far as one without, and θ's loss rose and fell in turn
    under the chaos trace). Rounds whose shares add up to whole rounds, each round's gradient its
    share of that whole round's, move θ and the momentum exactly as Nesterov SGD over the whole rounds
    (NumPy); a round of S > 1 shares as S Nesterov rounds of G / S; chunked as the outer step does."""
    import numpy as np

    from atoll.coordinator.state.delayed import DelayedNesterov

    gen = torch.Generator().manual_seed(5)
    theta0 = torch.randn(1000, generator=gen)
    whole = [torch.randn(1000, generator=gen) for _ in range(4)]
    splits = [[1.0], [0.25, 0.75], [0.5, 0.3, 0.2], [0.9, 0.1]]  # each whole round's work, in rounds
    for nesterov in (True, False):
        want, want_m = nesterov_reference(theta0.numpy(), [g.numpy() for g in whole], 0.7, 0.9, nesterov)
        opt = DelayedNesterov({"w": (1000,)}, lr=0.7, momentum=0.9, nesterov=nesterov, advance="even")
        theta = theta0.clone().double()
        for j, split in enumerate(splits):
            for share in split:
                opt.begin_round(share)
                u = whole[j] * share
                for start in range(0, 1000, 300):
                    opt.step_("w", u.narrow(0, start, min(300, 1000 - start)), start)
                opt.end_round()
                theta += u.double()
                assert opt.pending_share == 0.0
            np.testing.assert_allclose(theta.numpy(), want[j], rtol=1e-5, atol=1e-5, err_msg=f"whole round {j}")
        np.testing.assert_allclose(opt.buffers["w"].numpy(), want_m, rtol=1e-5, atol=1e-5)
        # one round of S = 2 shares: two Nesterov rounds of G / S
        two, m2 = nesterov_reference(want[-1], [whole[0].numpy()] * 2, 0.7, 0.9, nesterov, want_m)
        opt.begin_round(2.0)
        theta += opt.step_("w", whole[0] * 2.0).double()
        opt.end_round()
        np.testing.assert_allclose(theta.numpy(), two[-1], rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(opt.buffers["w"].numpy(), m2, rtol=1e-5, atol=1e-5)
    # Rounds of equal shares: every round moves θ by its share of what a full round would (no round
    # steps the momentum for the others), in steady state s x lr x ĝ / (1 - mu).
    steady = DelayedNesterov({"w": (1,)}, lr=1.0, momentum=0.5, nesterov=True, advance="even")
    steps = []
    for _ in range(40):
        steady.begin_round(0.8)
        steps.append(float(steady.step_("w", torch.tensor([0.8]))))
        steady.end_round()
    assert steps[-1] == pytest.approx(-0.8 * 1.0 / (1 - 0.5), rel=1e-5)
    assert all(b <= a + 1e-6 for a, b in zip(steps, steps[1:], strict=False))  # smooth: no round of a jump


def test_the_spread_rule_spreads_a_round_of_many_rounds_work_over_the_next_rounds():
    """``spread``: a round holding far more work than the rounds before it (an island's long carried
    delta) steps at most ``SPREAD_CAP`` x the usual share at once; the rest waits and joins the next
    rounds. Nothing is lost or counted twice: with one gradient throughout, θ and the momentum once it
    has all entered are exactly Nesterov SGD over the same whole rounds (NumPy), across a restart
    with work still waiting. Rounds of at most a full round's share step as ``even``."""
    import numpy as np

    from atoll.coordinator.state.delayed import DelayedNesterov

    gen = torch.Generator().manual_seed(9)
    g = torch.randn(1000, generator=gen)
    shares = [0.8, 0.8, 0.8, 0.8, 0.8, 3.0, 0.6, 0.4]  # 8 whole rounds' work
    kw = {"lr": 0.7, "momentum": 0.9, "nesterov": True}
    opt, even = (
        DelayedNesterov({"w": (1000,)}, **kw, advance="spread"),
        DelayedNesterov({"w": (1000,)}, **kw, advance="even"),
    )
    theta, steps = torch.zeros(1000, dtype=torch.float64), []
    for i, share in enumerate(shares + [0.0] * 3):  # rounds of no work: what waits still enters
        if i == 6:  # a coordinator restart, the work left waiting in the state
            assert opt.pending_share > 1.0
            saved = {k: v.clone() for k, v in opt.state_tensors().items()}
            opt = DelayedNesterov({"w": (1000,)}, **kw, advance="spread")
            opt.load_state_tensors(saved)
        opt.begin_round(share)
        even.begin_round(share)
        u, v = opt.step_("w", g * share), even.step_("w", g * share)
        opt.end_round()
        even.end_round()
        if i < 5:  # nothing capped yet: even's step (to float rounding: the terms are summed in another order)
            torch.testing.assert_close(u, v, rtol=1e-6, atol=1e-6)
        theta += u.double()
        steps.append(float(u.norm()))
    assert opt.pending_share == pytest.approx(0.0, abs=1e-12)
    want, want_m = nesterov_reference(np.zeros(1000), [g.numpy()] * 8, 0.7, 0.9, True)
    np.testing.assert_allclose(theta.numpy(), want[-1], rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(opt.buffers["w"].numpy(), want_m, rtol=1e-5, atol=1e-5)
    # the round of 3 shares stepped at most 1.5 x the usual share (~0.87) of a round: under 1.5 x its
    # neighbour's step, where even steps it whole; what waited joined the rounds after
    assert steps[5] < 1.5 * 1.5 * steps[4]
    assert steps[6] > steps[4] and steps[7] > steps[4]
    with pytest.raises(ValueError, match="advance must be one of once, progress, even, spread"):
        DelayedNesterov({"w": (4,)}, **kw, advance="every")


def even_reference(theta, rounds, lr, mu):
    """NumPy (float64) of the ``even`` rule, from the momentum's definition m_j = mu·m_{j-1} + ĝ: a
    round of share s and gradient g is s full rounds of ĝ = g / s, so m <- m_s = mu^s·m + (1 - mu^s) /
    (1 - mu)·ĝ and θ moves by -lr·(g + mu·Σ_{j=1..s} m_j), the sum taken in closed form for any s."""
    import numpy as np

    theta, m, out = theta.astype(np.float64), np.zeros_like(theta, np.float64), []
    for g, s in rounds:
        ghat, geo = g / s, mu * (1 - mu**s) / (1 - mu)  # geo: Σ_{j=1..s} mu^j
        sum_m = geo * m + (s - geo) / (1 - mu) * ghat
        theta = theta - lr * (g + mu * sum_m)
        m = mu**s * m + (1 - mu**s) / (1 - mu) * ghat
        out.append(theta)
    return out


@pytest.mark.parametrize("step", ["delayed", "even", "spread"])
def test_a_decoupled_run_with_delayed_nesterov_matches_numpy(start_server, raw_island, tmp_path, step):
    """Through the coordinator, rounds of one island each (quorum 1): θ after each round is NumPy's
    Delayed Nesterov (or its ``even`` rule) with the rounds' shares, and a coordinator restarted in
    the middle of a momentum cycle (``delayed``: 0.75 of a round's share pending; ``even`` holds
    nothing back) goes on from exactly where it was."""
    import numpy as np

    cfg, srv, a, b, theta0 = two_raw_islands(start_server, raw_island, tmp_path, step=step, lr=0.7, momentum=0.9)
    reference = delayed_nesterov_reference if step == "delayed" else even_reference  # (spread: no round over 1)
    shapes = {"w": (3, 4)}
    # (island, round, tokens, share): b is unknown in round 0 (a full round); then 300/400, 100/400, ...
    # and so on after the restart, which restores the islands' usual weights with the membership.
    plan = [("a", 0, 100, 1.0), ("b", 1, 300, 0.75), ("a", 2, 100, 0.25), ("b", 3, 300, 0.75)]
    plan += [("a", 4, 100, 0.25), ("a", 5, 100, 0.25), ("b", 6, 300, 0.75)]
    rounds = []
    for i, (who, r, tokens, share) in enumerate(plan):
        if i == 4:  # a coordinator restart with 0.75 of a round's share pending (a new port): it stays
            pending = srv.inspect(lambda s: s.model.optimizer.pending_share)
            assert pending == pytest.approx(0.75 if step == "delayed" else 0.0)
            srv.stop()
            srv = start_server(cfg, tmp_path)
            a, b = raw_island(srv.address, "a", shapes), raw_island(srv.address, "b", shapes)
            a.join()
            b.join()
        d = torch.randn(3, 4)
        isl = a if who == "a" else b
        assert isl.push({"w": d}, round_=r, tokens=tokens).committed
        assert isl.pull(r)[0].round == r + 1
        rounds.append((share * d.numpy(), share))
        want = reference(theta0.numpy(), rounds, 0.7, 0.9)[-1]
        got = srv.inspect(lambda s: s.model.params["w"].clone())
        np.testing.assert_allclose(got.numpy(), want, rtol=1e-5, atol=1e-5, err_msg=f"round {r}")
    records = srv.inspect(lambda s: [dict(h) for h in s.history])
    assert [rec["share"] for rec in records[-len(plan) :]] == pytest.approx([p[3] for p in plan])


def test_a_decoupled_island_waits_briefly_for_an_update_that_comes_at_once(start_server, monkeypatch):
    """Quorum 1, no grace: a's push closes its round at once. Waiting for it (a wait long enough for
    the exchange on a loaded machine: H tiny steps' compute times 10 may not be), a applies that update
    at the step that pushed (θ is θ_1: no step taken on θ_0 after the push)."""
    from atoll.islands import _diloco

    monkeypatch.setattr(_diloco, "update_wait_seconds", lambda fraction, compute, last: 30.0 * fraction)
    srv = start_server(config(quorum=1, outer_mode="decoupled", lease_seconds=60.0, grace_window="0"))
    model, opt, a = island(srv.address, island_id="a", update_wait=1.0, align_pushes=False)
    a.start()
    try:
        data = batches(H)
        for batch in data[:-1]:
            assert a.step(tokens=32, loss=inner_step(model, opt, batch)) is None
        stats = a.step(tokens=32, loss=inner_step(model, opt, data[-1]))  # pushes, and waits
        assert stats is not None and stats.round == 0 and not a._exchanges.in_flight()
        theta1 = a.global_params()
        for n, p in model.named_parameters():
            assert torch.allclose(p.detach(), theta1[n], atol=1e-6)  # (an inner step moves it ~1e-2)
    finally:
        a.close()


def test_a_decoupled_islands_wait_for_its_update_is_bounded_and_counted_as_blocked(start_server):
    """Quorum 2 and b never pushes: a's round cannot close. a waits at most ``update_wait`` times its
    push's compute time, trains on, and the wait is counted as blocked (not compute) in its next push."""
    srv = start_server(config(quorum=2, outer_mode="decoupled", lease_seconds=60.0))
    model, opt, a = island(srv.address, island_id="a", update_wait=2.0, align_pushes=False)
    a.start()
    try:
        for batch in batches(H):
            assert a.step(tokens=32, loss=inner_step(model, opt, batch)) is None
        (flight,) = a._exchanges.in_flight()
        compute = flight.pushes[0][1].compute_seconds
        blocked = a._schedule.routes[0].blocked
        assert flight.thread.is_alive() and compute > 0
        assert 2.0 * compute * 0.9 <= blocked <= 2.0 * compute + 0.5  # (join's own lateness)
    finally:
        a.close()


def test_the_decoupled_step_rules_are_a_registry_that_the_config_and_the_optimizer_read():
    """Each rule is data (its choices), looked up by name once; a name not in it is refused naming them."""
    from atoll.coordinator.config import RunConfig
    from atoll.coordinator.policy import steps
    from atoll.coordinator.state.delayed import DelayedNesterov
    from atoll.coordinator.state.model import GlobalModel

    assert list(steps.RULES) == ["share", "full", "delayed", "whole", "progress", "even", "spread"]
    assert RunConfig(run_id="t").decoupled_step == steps.DEFAULT == "spread"
    with pytest.raises(ValueError, match="decoupled_step must be one of share, full, delayed, whole, progress"):
        RunConfig(run_id="t", outer_mode="decoupled", decoupled_step="fast")
    assert [r.name for r in steps.RULES.values() if r.progress_share] == ["progress", "even", "spread"]
    assert [r.name for r in steps.RULES.values() if r.long_delta_whole] == ["whole"]
    assert [r.name for r in steps.RULES.values() if not r.by_share] == ["full"]
    for name in steps.RULES:
        model = GlobalModel(RunConfig(run_id="t", outer_mode="decoupled", decoupled_step=name))
        model.define({"w": (4,)}, frozenset(), None)
        delayed = isinstance(model.optimizer, DelayedNesterov)
        assert delayed == (name not in ("share", "full")), name
        assert not delayed or model.optimizer.advance == {"progress": "progress", "even": "even"}.get(
            name, "spread" if name == "spread" else "once"
        )
    sync = GlobalModel(RunConfig(run_id="t", decoupled_step="even"))  # sync mode: the rule does not apply
    sync.define({"w": (4,)}, frozenset(), None)
    assert not isinstance(sync.optimizer, DelayedNesterov)
