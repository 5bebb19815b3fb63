"""Decoupled runs: the coordinator tells each island where its push landed in its round, and the island
moves its next pushes by it, so the islands' pushes come together. (Before: nothing brought them back
together once they drifted; with three islands of equal speed the first push of a round committed
0.3-0.6 s before the last in a ~1.1 s round, and that island trained all that time on a θ the round was
about to replace: benchmarks/RESULTS.md.)"""

from __future__ import annotations

import asyncio
import itertools
import statistics

import pytest
from support import FakeClock, H, batches, config, inner_step, island, wait_for
from support.core import join, pull, push, rand, run_state

from atoll.coordinator.policy.phase import arrival_offsets
from atoll.islands import _schedule
from atoll.islands._schedule import RouteCount
from atoll.protos.vocabulary import PushKind, UpdateKind


def test_each_island_hears_how_far_its_push_landed_from_the_rounds_median(tmp_path):
    """Three fresh pushes at +0, +0.5 and +1.7 s: the median is b's, so a hears -0.5, b 0 and c +1.2,
    each with the update that closes the round (DELTA or FULL), and never with a later one."""
    clock = FakeClock()
    s = run_state(tmp_path, clock, quorum=1, outer_mode="decoupled", grace_window="off")
    for who in "abc":
        join(s, who)
    asyncio.run(push(s, "a", rand(0), kind=PushKind.INIT))
    for who, at in (("a", 0.0), ("b", 0.5), ("c", 1.7)):
        clock.now = 200.0 + at
        assert asyncio.run(push(s, who, rand(ord(who)), round_=0)).committed
    asyncio.run(s.close_round("test"))
    got = {who: pull(s, who, have) for who, have in (("a", 0), ("b", 0), ("c", -1))}
    assert (got["a"].kind, got["b"].kind, got["c"].kind) == (UpdateKind.DELTA, UpdateKind.DELTA, UpdateKind.FULL)
    assert {who: answer.arrival_offset for who, answer in got.items()} == pytest.approx({"a": -0.5, "b": 0.0, "c": 1.2})
    # Round 1 holds a's push alone: nothing to align with, and round 0's figure is not sent again.
    clock.now = 210.0
    asyncio.run(push(s, "a", rand(9), round_=1))
    asyncio.run(s.close_round("test"))
    assert pull(s, "a", 1).arrival_offset is None
    assert pull(s, "b", 1).arrival_offset is None


def test_a_sync_run_sends_no_offsets(tmp_path):
    clock = FakeClock()
    s = run_state(tmp_path, clock, quorum=2)
    join(s, "a")
    join(s, "b")
    asyncio.run(push(s, "a", rand(0), kind=PushKind.INIT))
    for who, at in (("a", 0.0), ("b", 3.0)):
        clock.now = 200.0 + at
        asyncio.run(push(s, who, rand(ord(who)), round_=0))
    asyncio.run(s.close_round("test"))
    assert pull(s, "a", 0).arrival_offset is None


def test_the_median_not_the_mean_so_one_far_island_moves_only_itself():
    offsets = arrival_offsets({"a": 10.0, "b": 10.2, "slow": 19.0})
    assert offsets == pytest.approx({"a": -0.2, "b": 0.0, "slow": 8.8})
    assert arrival_offsets({"a": 10.0}) == {}


def test_a_push_that_landed_early_moves_the_next_one_by_half_and_every_one_after_by_a_tenth():
    count = RouteCount(pushed=1)
    assert count.due_after(50) == 50
    count.aligned(-0.4, 0.02, 50)  # landed 20 steps before the median
    assert (count.shift, count.period) == (10, pytest.approx(2.0))
    assert count.due_after(50) == 62
    count.restart(0.0)  # that push went: the phase shift was for it alone
    assert count.due_after(50) == 52
    count.aligned(0.3, 0.01, 50)  # then 30 steps after it
    assert (count.shift, count.period) == (-15, pytest.approx(-1.0))
    assert count.due_after(50) == 34
    for _ in range(100):  # always late: the period stops at -H/2, and a push never comes before H/2 steps
        count.aligned(5.0, 0.01, 50)
    assert count.period == -25.0 and count.due_after(50) == 25
    count.aligned(float("nan"), 0.01, 50)
    count.aligned(1.0, 0.0, 50)
    assert count.due_after(50) == 25
    assert RouteCount(pushed=0, first_sync=7).due_after(50) == 7


def simulate(step_seconds: list[float], rounds: int, *, align: bool) -> list[float]:
    """Islands that never wait, each pushing every ``due_after`` of its own steps (one push per round,
    as in a decoupled run whose rounds wait for every island), aligned by the coordinator's offsets or
    not: each round's spread, its last commit minus its first."""
    counts = [RouteCount(pushed=1) for _ in step_seconds]
    at = [0.37 * i for i in range(len(step_seconds))]  # the pushes start a third of a round apart
    spreads = []
    for _ in range(rounds):
        spreads.append(max(at) - min(at))
        offsets = arrival_offsets({str(i): t for i, t in enumerate(at)})
        for i, (count, step) in enumerate(zip(counts, step_seconds, strict=True)):
            count.restart(at[i])
            if align:
                count.aligned(offsets[str(i)], step, 50)
            at[i] += count.due_after(50) * step
    return spreads


def test_pushes_come_together_even_with_an_island_a_little_slower_per_step():
    """Speeds 1 : 1 : 1.06 (three islands sharing two cores are never quite equal): unaligned, the
    pushes stay a third of a round apart and the slower island drifts on; aligned, they land within
    one and a half steps of each other (a push goes out at a whole step) from round 15 on."""
    steps = [0.022, 0.022, 0.022 * 1.06]
    apart = simulate(steps, 40, align=False)
    together = simulate(steps, 40, align=True)
    assert min(apart[15:]) > 0.5
    assert max(together[15:]) < 1.5 * 0.022 and together[0] == apart[0]


def test_a_period_gain_past_the_stability_bound_makes_the_pushes_swing_apart(monkeypatch):
    """The gains' stability condition (the module's note): PERIOD_GAIN < 4 - 2 x PHASE_GAIN = 3."""
    steps = [0.022, 0.022, 0.022 * 1.06]
    monkeypatch.setattr(_schedule, "PERIOD_GAIN", 3.5)
    assert statistics.mean(simulate(steps, 40, align=True)[20:]) > 0.5


def test_a_decoupled_island_pushes_later_after_landing_first(start_server):
    """a pushes at H and b only after 3H steps of its own: a landed first, by about H of its steps
    from the median, and its next push goes out at H + half that (the phase) + a tenth (the period), in
    a's own steps as a measured them; b, last, pushes sooner. Nothing else changed: both rounds close."""
    srv = start_server(config(quorum=2, outer_mode="decoupled", lease_seconds=60.0))
    a_model, a_opt, a = island(srv.address, island_id="a")
    b_model, b_opt, b = island(srv.address, island_id="b")
    a.start()
    b.start()
    # a's own measure of its steps (what its push reports and its offset is divided by) ticks 10 us a
    # reading: far shorter than b's 3H real steps, so a's offset is past the clamp of 2H steps whatever
    # the machine's load. (Measured by the wall clock, a loaded machine once made a's first H steps
    # look six times longer than b's 3H: a shift of 0, and "assert 4 > 4".)
    ticks = itertools.count()
    a._schedule.clock = lambda: next(ticks) * 1e-5
    a._schedule.begin(a._schedule.sync_every)
    try:
        data = batches(3 * H)
        for batch in data[:H]:
            a.step(tokens=32, loss=inner_step(a_model, a_opt, batch))
        wait_for(lambda: srv.inspect(lambda s: "a" in s.accumulator.committed))
        (flight,) = a._exchanges.in_flight()
        pushed = flight.pushes[0][1]
        for batch in data:
            b.step(tokens=32, loss=inner_step(b_model, b_opt, batch))
        wait_for(lambda: srv.inspect(lambda s: s.round) == 1)
        offset = srv.inspect(lambda s: s.membership.offset_for("a", 0))
        assert offset < 0 and srv.inspect(lambda s: s.membership.offset_for("b", 0)) == pytest.approx(-offset)
        wait_for(lambda: not flight.thread.is_alive())
        a.step(tokens=0)  # applies round 0's update
        steps = max(-2.0 * H, offset / (pushed.compute_seconds / pushed.inner_steps))  # (clamped at 2H)
        assert steps == -2.0 * H
        count = a._schedule.routes[0]
        assert count.shift == -round(0.5 * steps) and count.period == pytest.approx(-0.1 * steps)
        due = count.due_after(H)
        assert due > H
        for batch in data[: due - 2]:  # (the step that applied the update counted as one)
            a.step(tokens=32, loss=inner_step(a_model, a_opt, batch))
        assert not a._exchanges.in_flight()  # one step short
        a.step(tokens=32, loss=inner_step(a_model, a_opt, data[0]))
        (nxt,) = a._exchanges.in_flight()
        assert nxt.steps == due and nxt.round == 1
    finally:
        a.close()
        b.close()


def test_a_decoupled_island_waits_for_its_update_only_while_its_exchanges_come_back_within_the_wait():
    """0.2 of a push of 1.1 s of compute: 0.22 s, when the last exchange took up to 1.5 times that, 0.33 s
    (or there was none); nothing when it took 0.5 s (its rounds wait for slower islands)."""
    from atoll.islands._schedule import update_wait_seconds

    assert update_wait_seconds(0.2, 1.1, None) == pytest.approx(0.22)
    assert update_wait_seconds(0.2, 1.1, 0.15) == pytest.approx(0.22)
    assert update_wait_seconds(0.2, 1.1, 0.33) == pytest.approx(0.22)
    assert update_wait_seconds(0.2, 1.1, 0.34) == 0.0
    assert update_wait_seconds(0.2, 1.1, 0.5) == 0.0
    assert update_wait_seconds(0.0, 1.1, None) == 0.0
