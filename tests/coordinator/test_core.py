"""The coordinator's core driven by hand through its message types, with a fake clock and a real state
dir: no gRPC, no threads of ours. θ_0 and every round take the one seal -> persist -> publish path."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch
from support import FakeClock
from support.core import IDENT, SHAPES, join, pull, push, rand, run_state

from atoll.coordinator.disk import snapshots, wal
from atoll.coordinator.messages import IslandCall, PullRequest
from atoll.coordinator.policy.rounds import Decision, decide
from atoll.coordinator.run.decider import view
from atoll.protos.vocabulary import PushKind, PushOutcome, UpdateKind


def test_theta0_and_a_round_take_the_one_path_and_match_a_numpy_reference(tmp_path):
    s = run_state(tmp_path, outer_lr=0.7, outer_momentum=0.9)
    assert join(s, "a").bootstrap and not join(s, "b").bootstrap
    theta0, da, db = rand(0), rand(1), rand(2)
    got = asyncio.run(push(s, "a", theta0, kind=PushKind.INIT))
    assert got.outcome is PushOutcome.COMMITTED and s.round == 0 and s.model.ready
    assert snapshots.load(tmp_path / "state").round == 0  # saved before it was published
    answer = pull(s, "b", -1)
    assert answer.kind is UpdateKind.FULL and answer.round == 0
    assert [r.committed for r in (asyncio.run(push(s, "a", da, tokens=3)), asyncio.run(push(s, "b", db, tokens=1)))]

    decision, reason = decide(s.clock(), view(s), s.policy())
    assert decision is Decision.CLOSE and "all 2 live islands committed" in reason
    asyncio.run(s.close_round(reason))

    for n in SHAPES:  # mean Δ (token-weighted), then Nesterov from zero momentum: u = -lr (g + μ g)
        g = (3 * da[n].numpy() + db[n].numpy()) / 4
        want = theta0[n].numpy() - 0.7 * (g + 0.9 * g)
        np.testing.assert_allclose(s.model.params[n].numpy(), want, rtol=1e-6, atol=1e-6)
    snap = snapshots.load_live(tmp_path / "state")  # the background writer of round 1 may be pruning
    assert snap.round == 1 and snap.history[0]["islands"] == ["a", "b"] and snap.history[0]["tokens"] == 4
    assert all(torch.equal(snap.params[n], s.model.params[n]) for n in SHAPES)
    delta = pull(s, "a", 0)
    assert (delta.kind, delta.round) == (UpdateKind.DELTA, 1)


@pytest.mark.parametrize("mode", ["sync", "decoupled"])
def test_a_delta_of_more_than_h_steps_enters_a_decoupled_mean_scaled_to_h_steps(tmp_path, mode):
    """(Before: in a decoupled run an island that trained 3H steps while its exchange was out pushed a
    delta three times the size and three times the weight of the others; the outer step overshot and
    θ's eval loss jumped, benchmarks/RESULTS.md.) It enters scaled by H/n, weighing its tokens; sync
    mode is unchanged. (The ``whole`` rule, the default for new runs since, enters it whole: below.)"""
    s = run_state(tmp_path, outer_lr=1.0, outer_momentum=0.0, sync_every=2, outer_mode=mode, decoupled_step="delayed")
    join(s, "a")
    join(s, "b")
    theta0, da, db = rand(0), rand(1), rand(2)
    asyncio.run(push(s, "a", theta0, kind=PushKind.INIT))
    asyncio.run(push(s, "a", da, tokens=2, inner_steps=2))
    asyncio.run(push(s, "b", db, tokens=6, inner_steps=6))  # 3H steps
    asyncio.run(s.close_round("test"))
    scale = 1 / 3 if mode == "decoupled" else 1.0
    for n in SHAPES:
        want = theta0[n].numpy() - (2 * da[n].numpy() + 6 * scale * db[n].numpy()) / 8
        np.testing.assert_allclose(s.model.params[n].numpy(), want, rtol=1e-6, atol=1e-6)


def a_long_delta_then_a_round_of_one(tmp_path, rule: str, **config):
    """A decoupled run (H=2, lr 1) of a and b under ``rule``: round 0 holds a's 2-step delta and b's
    3H-step one, round 1 a's alone. Returns (state, θ_0, Δa, Δb, Δa of round 1)."""
    s = run_state(tmp_path, outer_lr=1.0, sync_every=2, outer_mode="decoupled", decoupled_step=rule, **config)
    join(s, "a")
    join(s, "b")
    theta0, da, db, da2 = rand(0), rand(1), rand(2), rand(3)
    asyncio.run(push(s, "a", theta0, kind=PushKind.INIT))
    asyncio.run(push(s, "a", da, tokens=2, inner_steps=2))
    asyncio.run(push(s, "b", db, tokens=6, inner_steps=6))  # 3H steps
    asyncio.run(s.close_round("test"))
    asyncio.run(push(s, "a", da2, tokens=2, inner_steps=2, round_=1))
    asyncio.run(s.close_round("test"))
    return s, theta0, da, db, da2


def test_a_long_delta_enters_whole_under_the_whole_rule_and_its_island_weighs_per_h_steps(tmp_path):
    """(On the quality map an island that trained 3-14x H steps while its round waited, e.g. while round
    0 waited for a slow island, had 1 − H/n of that progress dropped by the H/n scale: θ's loss stood
    still for ~1M tokens.) Under ``whole`` the 3H-step delta enters whole with its tokens' weight, and
    b's usual weight is its weight per H steps (2, not 6), so a's next round alone steps by 2/4 of a
    round, not 2/8. Exact values: lr 1, no momentum."""
    s, theta0, da, db, da2 = a_long_delta_then_a_round_of_one(tmp_path, "whole", outer_momentum=0.0)
    assert [h["share"] for h in s.history] == [1.0, 0.5]
    for n in SHAPES:
        want = theta0[n].numpy() - (2 * da[n].numpy() + 6 * db[n].numpy()) / 8 - 0.5 * da2[n].numpy()
        np.testing.assert_allclose(s.model.params[n].numpy(), want, rtol=1e-6, atol=1e-6)


def test_under_progress_a_long_delta_enters_as_its_islands_share_and_steps_as_the_rounds_of_work_it_holds(tmp_path):
    """(Under ``whole``, rounds made of one long delta (3-4.7x H steps, while an island's exchange was
    out or late by 3 rounds) stepped by it at full size, N times its island's share, and the outer
    momentum took it: θ's loss rose for one round three times under the chaos trace.) Under
    ``progress`` each island's progress since its last push enters as its share of a round of everyone,
    (Δa + Δb)/2 here, b's 3H-step delta once; the round holds 2 full rounds' work (8 tokens against
    2 + 2 per H steps), so its momentum part is that of two Nesterov steps of g/2. a's next round alone
    is half a round: a plain step. Exact values, lr 1, momentum 0.9."""
    s, theta0, da, db, da2 = a_long_delta_then_a_round_of_one(tmp_path, "progress")
    assert [h["share"] for h in s.history] == [2.0, 0.5]
    for n in SHAPES:
        g = (da[n].numpy() + db[n].numpy()) / 2
        m1 = g / 2
        m2 = 0.9 * m1 + g / 2
        want = theta0[n].numpy() - (g + 0.9 * m1 + 0.9 * m2) - 0.5 * da2[n].numpy()
        np.testing.assert_allclose(s.model.params[n].numpy(), want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("at", ["theta0", "round"])
def test_a_failed_save_keeps_it_sealed_and_the_same_path_publishes_it_later(tmp_path, monkeypatch, at):
    """θ_0's durable write is its snapshot, a round's its log record."""
    s = run_state(tmp_path)
    join(s, "a")
    module, name = (snapshots, "save") if at == "theta0" else (wal, "append")
    real_save, broken = getattr(module, name), [True]

    def save(*a, **kw):
        if broken[0]:
            raise OSError(28, "No space left on device")
        return real_save(*a, **kw)

    if at == "round":
        asyncio.run(push(s, "a", rand(0), kind=PushKind.INIT))
    monkeypatch.setattr(module, name, save)
    if at == "theta0":
        assert asyncio.run(push(s, "a", rand(0), kind=PushKind.INIT)).committed
    else:
        asyncio.run(push(s, "a", rand(1)))
        asyncio.run(s.close_round("test"))
    want = 0 if at == "theta0" else 1
    assert s.ledger.sealed is not None and s.round == 0 and "No space left" in s.problem
    if at == "theta0":
        assert snapshots.load(tmp_path / "state") is None and not s.model.ready
        assert "θ_0 is being saved" in pull(s, "a", -1).waiting
    else:
        answer = pull(s, "a", 0)
        assert answer.kind is UpdateKind.NOT_READY and answer.committed
    assert asyncio.run(s.try_publish()) is False and s.ledger.sealed.failures == 2
    broken[0] = False
    assert asyncio.run(s.try_publish()) is True
    assert s.ledger.sealed is None and s.problem is None and s.round == want and s.model.ready
    assert snapshots.load_live(tmp_path / "state").round == want


def test_a_full_pull_during_a_publish_gets_the_theta_of_the_round_it_names(tmp_path, monkeypatch):
    """A publish installs θ_{r+1}, takes the replaced θ as the next round's sum (in a worker thread; it
    zeroed it there until the sum learnt to count old values as zero), then opens round r+1. A
    full-θ pull landing during that used to get θ_1 labelled round 0,
    and its island added round 0's update on top of it (a tentative update broken by a failed save,
    then this; caught in CI by test_tentative). It now waits for the round to open."""
    import threading

    s = run_state(tmp_path)
    join(s, "a")
    theta0 = rand(0)
    asyncio.run(push(s, "a", theta0, kind=PushKind.INIT))
    assert asyncio.run(push(s, "a", rand(1), tokens=1)).committed
    real, zeroing, release = s.model.sums, threading.Event(), threading.Event()

    def held_sums(reuse=None):
        zeroing.set()
        assert release.wait(10)  # set once the pull waits
        return real(reuse)

    monkeypatch.setattr(s.model, "sums", held_sums)

    async def pull_while_zeroing():
        closing = asyncio.ensure_future(s.close_round("test"))
        await asyncio.to_thread(zeroing.wait, 10)
        pulling = asyncio.ensure_future(s.pull(PullRequest(run_id="t", island_id="a", session_id="a", have_round=-1)))
        await asyncio.sleep(0)  # the pull runs up to its first wait
        assert not pulling.done()  # it waits for the publish: no θ labelled with a round it is not
        release.set()
        answer = await pulling
        await closing
        return answer

    answer = asyncio.run(pull_while_zeroing())
    assert answer.kind is UpdateKind.FULL and s.round == 1
    got = {e.name: IDENT.decode(b"".join(e.parts()), SHAPES[e.name]) for e in answer.entries}
    want = theta0 if answer.round == 0 else s.model.params
    assert all(torch.equal(got[n], want[n]) for n in SHAPES), answer.round
    assert answer.round == 1  # it waited for the publish


def test_a_round_closes_at_its_deadline_with_quorum_by_the_clock(tmp_path):
    clock = FakeClock()
    s = run_state(tmp_path, clock, quorum=1, round_deadline_seconds=30.0, lease_seconds=600.0)
    join(s, "a")
    join(s, "b")
    asyncio.run(push(s, "a", rand(0), kind=PushKind.INIT))
    asyncio.run(push(s, "a", rand(1)))
    clock.now += 29.0
    assert decide(clock(), view(s), s.policy())[0] is Decision.WAIT
    clock.now += 1.0
    decision, reason = decide(clock(), view(s), s.policy())
    assert decision is Decision.CLOSE
    asyncio.run(s.close_round(reason))
    assert s.round == 1 and s.history[0]["islands"] == ["a"] and s.history[0]["seconds_open"] == 30.0
    late = asyncio.run(push(s, "b", rand(2), round_=0))
    assert late.outcome is PushOutcome.FOLDED and late.committed  # the default: folded into round 1
    assert s.accumulator.late[("b", 0)].weight == 0.5  # a round late: staleness_weight ** 1 of its 1 token


def test_a_push_that_arrives_while_its_round_is_being_saved_is_folded_into_the_next(tmp_path, monkeypatch):
    """(Before: a push that reached the coordinator between a round's outer step and its publish was
    dropped, late policy or not.) It waits for the publish and is folded into the next round; a push
    more than max_staleness rounds late is still dropped, as an outcome."""
    clock = FakeClock()
    s = run_state(tmp_path, clock, quorum=1, lease_seconds=1e6, max_staleness=1)
    join(s, "a")
    join(s, "b")
    asyncio.run(push(s, "a", rand(0), kind=PushKind.INIT))

    real_save, broken = wal.append, [True]

    def save(*a, **kw):
        if broken[0]:
            raise OSError(28, "No space left on device")
        return real_save(*a, **kw)

    monkeypatch.setattr(wal, "append", save)

    async def race():
        await push(s, "a", rand(1), round_=0)
        await s.close_round("quorum")  # the outer step is computed; its save fails for now
        late = asyncio.create_task(push(s, "b", rand(2), round_=0))
        await asyncio.sleep(0.05)  # a window for the push to be (wrongly) answered: an absence has no event
        assert not late.done() and s.ledger.sealed is not None  # it waits for the publish, not dropped
        broken[0] = False
        assert await s.try_publish()
        return await late

    got = asyncio.run(race())
    assert got.outcome is PushOutcome.FOLDED and s.round == 1 and ("b", 0) in s.accumulator.late
    asyncio.run(push(s, "a", rand(3), round_=1))
    asyncio.run(s.close_round("quorum"))
    assert s.history[1]["late"] == [["b", 0]] and s.history[1]["tokens_by_island"] == {"a": 1, "b": 1}
    asyncio.run(push(s, "a", rand(4), round_=2))
    asyncio.run(s.close_round("quorum"))
    again = asyncio.run(push(s, "a", rand(3), round_=1))  # a re-push (a restarted island): counted once
    assert again.outcome is PushOutcome.DUPLICATE and again.committed
    assert asyncio.run(push(s, "b", rand(2), round_=0)).outcome is PushOutcome.DUPLICATE  # folded once
    stale = asyncio.run(push(s, "b", rand(5), round_=1))  # 2 rounds late, max_staleness 1
    assert stale.outcome is PushOutcome.ROUND_CLOSED and not stale.committed
    asyncio.run(push(s, "a", rand(6), round_=3))
    asyncio.run(s.close_round("quorum"))
    assert s.history[3]["too_stale"] == [["b", 1]] and s.history[3]["late"] == []


def test_a_finished_run_waits_for_nothing_and_says_so(tmp_path):
    """(Before: `atoll status` kept the last "waiting for ..." line of a finished run.)"""
    from atoll.tools import format_status

    s = run_state(tmp_path, total_rounds=1)
    join(s, "a")
    join(s, "b")
    asyncio.run(push(s, "a", rand(0), kind=PushKind.INIT))
    asyncio.run(push(s, "a", rand(1)))
    s.waiting = decide(s.clock(), view(s), s.policy())[1]
    assert "waiting for b" in s.waiting
    asyncio.run(s.close_round("test"))
    assert s.run_complete and s.waiting == "" and not s.finished()  # b never pulled its final θ
    pull(s, "a", 0)
    pull(s, "b", 0)
    assert s.finished()
    status = {
        "run": {"run_id": "t", "sync_every": 1, "codec": "identity", "outer_lr": 0.7, "outer_momentum": 0.9},
        "round": 1,
        "run_complete": True,
        "waiting": "round 0: 1 committed, waiting for b",
        "islands": [],
    }
    status["run"]["quorum"] = 1
    assert "waiting" not in format_status(status) and "(complete)" in format_status(status)


def test_the_grace_window_learns_when_an_island_arrives_and_stops_waiting_after_it(tmp_path):
    """A run of quorum 1 whose island b commits 3 s into every round; when b stalls, the round closes
    at b's expected arrival (mean + 4 deviations = +6.4 s), not at the 600 s deadline, and the round
    record says why."""
    clock = FakeClock()
    s = run_state(tmp_path, clock, quorum=1, round_deadline_seconds=600.0, lease_seconds=1e6)
    join(s, "a")
    join(s, "b")
    asyncio.run(push(s, "a", rand(0), kind=PushKind.INIT))
    for r in range(3):
        clock.now = s.ledger.opened_at + 1.0
        asyncio.run(push(s, "a", rand(1), round_=r))
        clock.now += 2.0
        asyncio.run(push(s, "b", rand(2), round_=r))
        decision, reason = decide(clock(), view(s), s.policy())
        assert decision is Decision.CLOSE and "all 2 live islands committed" in reason
        asyncio.run(s.close_round(reason))
    assert s.membership.islands["b"].arrival.expected() == 3.0 + 4 * 0.84375
    clock.now = s.ledger.opened_at + 1.0
    asyncio.run(push(s, "a", rand(1), round_=3))  # b stalls this round
    clock.now = s.ledger.opened_at + 6.3
    assert decide(clock(), view(s), s.policy())[0] is Decision.WAIT
    clock.now = s.ledger.opened_at + 6.375
    decision, reason = decide(clock(), view(s), s.policy())
    assert (
        decision is Decision.CLOSE and reason == "round 3: grace 5.4s after quorum: b expected at +6.4s; b did not come"
    )
    asyncio.run(s.close_round(reason))
    assert s.history[3]["islands"] == ["a"] and s.history[3]["reason"] == reason


def test_goodput_counts_the_compute_whose_tokens_entered_theta_over_the_time_joined(tmp_path):
    """A hand-made trace: a computes 8 s of every 10 s round and each push enters θ; b computes 8 s too,
    but its round-1 push arrives after the round closed and is dropped (late_policy drop), so
    those 8 s do not count; c left after one round, and its share still counts for the run."""
    from atoll.coordinator.policy.goodput import run_goodput

    clock = FakeClock(0.0)
    s = run_state(
        tmp_path, clock, quorum=1, lease_seconds=1e6, grace_window="off", round_deadline_seconds=9.0, late_policy="drop"
    )
    for i in "abc":
        join(s, i)
    asyncio.run(push(s, "a", rand(0), kind=PushKind.INIT))
    clock.now = 10.0
    for i in "abc":
        assert asyncio.run(push(s, i, rand(1), round_=0, compute_seconds=8.0, blocked_seconds=2.0)).committed
    asyncio.run(s.close_round("all in"))
    s.leave(IslandCall(run_id="t", island_id="c", session_id="c"))
    clock.now = 20.0
    asyncio.run(push(s, "a", rand(2), round_=1, compute_seconds=8.0, blocked_seconds=2.0))
    asyncio.run(s.close_round("deadline"))  # b is late
    late = asyncio.run(push(s, "b", rand(3), round_=1, compute_seconds=8.0, blocked_seconds=2.0))
    assert late.outcome is PushOutcome.ROUND_CLOSED
    a, b = (s.membership.islands[i].goodput for i in "ab")
    assert (a.compute_into_theta, a.blocked_seconds, a.tokens_into_theta) == (16.0, 4.0, 2)
    assert (a.ratio(20.0), b.ratio(20.0)) == (0.8, 0.4)
    (c,) = s.membership.past_goodput
    assert (c.wall(20.0), c.ratio(20.0)) == (10.0, 0.8)
    assert run_goodput(s.membership.goodput(), 20.0) == (16 + 8 + 8) / (20 + 20 + 10)
    assert s.history[0]["compute_seconds_by_island"] == {"a": 8.0, "b": 8.0, "c": 8.0}
    assert s.history[0]["goodput"] == 24 / 30 and s.history[1]["goodput"] == (16 + 8 + 8) / (20 + 20 + 10)


def test_an_island_reports_its_compute_and_blocked_seconds_with_each_push():
    from atoll.islands._schedule import Schedule

    clock = FakeClock(0.0)
    sched = Schedule(1, streaming=False, sync_every_seconds=None, clock=clock)
    sched.begin(4)
    clock.now = 10.0
    sched.was_blocked(2.5)  # an exchange of the previous round, finished in this one
    assert sched.routes[0].compute_seconds(clock()) == 7.5 and sched.routes[0].blocked == 2.5
    sched.synced([0])
    assert (sched.routes[0].blocked, sched.routes[0].compute_seconds(12.0)) == (0.0, 2.0)


def test_tokens_per_step_counts_only_reports_that_give_both():
    from atoll.coordinator.policy.goodput import tokens_per_step

    assert tokens_per_step([(100, 5), (0, 3), (50, None), (30, 5)]) == 13.0
    assert tokens_per_step([(0, 3), (50, 0)]) is None and tokens_per_step([]) is None


def test_a_decoupled_grace_follows_the_cycles_the_coordinator_sees_not_a_reported_compute(tmp_path):
    """The cap of a decoupled round's grace was half the smallest compute_seconds an island reported:
    a reporting 1e-6 s closed every round at its commit, and b's on-time push was folded at half
    weight. The cap is now half the quorum's cycle as the coordinator sees it (the time between an
    island's commits), with a floor: b, 0.8 s after a as in every round, commits to the round."""
    clock = FakeClock()
    s = run_state(tmp_path, clock, quorum=1, outer_mode="decoupled", round_deadline_seconds=600.0, lease_seconds=1e6)
    join(s, "a")
    join(s, "b")
    asyncio.run(push(s, "a", rand(0), kind=PushKind.INIT))
    for r in range(4):
        clock.now = s.ledger.opened_at + 1.0
        asyncio.run(push(s, "a", rand(1), round_=r, compute_seconds=1e-6))
        if r == 3:
            break
        clock.now += 0.8
        asyncio.run(push(s, "b", rand(2), round_=r, compute_seconds=1.8))
        decision, reason = decide(clock(), view(s), s.policy())
        assert decision is Decision.CLOSE
        asyncio.run(s.close_round(reason))
    clock.now = s.ledger.opened_at + 1.5
    assert decide(clock(), view(s), s.policy())[0] is Decision.WAIT  # before: closed at a's commit
    clock.now = s.ledger.opened_at + 1.8
    assert asyncio.run(push(s, "b", rand(2), round_=3, compute_seconds=1.8)).outcome is PushOutcome.COMMITTED
