"""Membership built by hand with a moved clock: leases, sessions, departures, the bootstrap claim."""

from __future__ import annotations

import pytest
from support import FakeClock

from atoll.coordinator.errors import Reason, RequestError
from atoll.coordinator.state.membership import IslandState, Membership, island_state


def membership(lease: float = 10.0) -> tuple[Membership, FakeClock]:
    clock = FakeClock()
    return Membership(clock, lambda: lease), clock


# ---- membership -------------------------------------------------------------------------------
def test_leases_expire_and_renew_with_calls():
    m, clock = membership()
    rec, new = m.join("a", num_ranks=1, session_id="s1", round_=0)
    assert new and rec.lease_expires_at == 110.0
    clock.now = 105.0
    m.touch("a", "s1")
    assert rec.lease_expires_at == 115.0
    clock.now = 115.0
    assert [r.island_id for r in m.newly_expired()] == ["a"] and m.newly_expired() == []  # reported once
    assert island_state(rec, clock(), 0) == IslandState.GONE
    with pytest.raises(RequestError) as info:
        m.touch("ghost")
    assert info.value.reason is Reason.NOT_JOINED


def test_a_second_live_process_with_the_same_id_is_refused_and_takes_over_once_the_lease_lapses():
    m, clock = membership()
    m.join("a", num_ranks=1, session_id="first", round_=0)
    with pytest.raises(RequestError) as info:
        m.join("a", num_ranks=1, session_id="second", round_=0)
    assert info.value.reason is Reason.SESSION_CONFLICT and "another live process" in info.value.message
    rec, _ = m.join("a", num_ranks=1, session_id="first", round_=0)  # the same process again: welcome
    clock.now = rec.lease_expires_at
    rec, new = m.join("a", num_ranks=1, session_id="second", round_=3)
    assert new and rec.session_id == "second" and rec.joined_round == 3
    with pytest.raises(RequestError) as info:  # the old process is now a stranger
        m.touch("a", "first")
    assert info.value.reason is Reason.NOT_JOINED


def test_a_restored_member_is_claimed_by_the_first_session_that_joins():
    m, _ = membership()
    m.restore({"a": {"num_ranks": 2, "joined_round": 1, "rounds_committed": 3}}, {"b": IslandState.LEFT})
    assert list(m.islands) == ["a"] and m.islands["a"].session_id == ""
    rec, new = m.join("a", num_ranks=2, session_id="s", round_=4)
    assert not new and rec.session_id == "s" and rec.rounds_committed == 3


def test_departures_are_remembered_and_eviction_is_for_good():
    m, _ = membership()
    for i in "abc":
        m.join(i, num_ranks=1, session_id=i, round_=0)
    m.leave("a")
    m.evict("b")
    assert sorted(m.islands) == ["c"] and m.departed == {"a": IslandState.LEFT, "b": IslandState.EVICTED}
    assert m.to_json()["departed"] == m.departed
    m.join("a", num_ranks=1, session_id="a2", round_=1)  # a left cleanly: it may come back
    assert "a" not in m.departed
    with pytest.raises(RequestError) as info:
        m.join("b", num_ranks=1, session_id="b2", round_=1)
    assert info.value.reason is Reason.EVICTED
    with pytest.raises(KeyError):
        m.evict("nobody")


def test_the_bootstrap_claim_moves_when_its_holder_leaves_or_goes_silent():
    m, clock = membership(lease=5.0)
    m.join("rogue", num_ranks=1, session_id="r", round_=0)
    m.join("real", num_ranks=1, session_id="x", round_=0)
    assert m.claim_bootstrap("rogue") and not m.claim_bootstrap("real")
    clock.now += 3.0
    m.touch("real", "x")
    clock.now += 2.5  # the rogue's lease lapsed, the real island's did not
    assert m.claim_bootstrap("real") and m.bootstrapper == "real"
    m.leave("real")
    assert m.bootstrapper is None


def test_an_island_that_keeps_up_is_never_late_when_others_close_rounds_without_it():
    """Quorum below the islands (decoupled, or quorum 1): the slow island's push closes round 6 while
    the fast one, which closed round 5 and holds θ_6, is at work on it: it is active (it showed as
    `late`). One that holds an old θ, or pulls fresh θ but pushes nothing that counts, is late."""
    m, clock = membership()
    fast, _ = m.join("fast", num_ranks=1, session_id="f", round_=0)
    fast.last_committed_round, fast.holds_round = 5, 6
    assert island_state(fast, clock(), 7) == IslandState.ACTIVE  # round 6 closed by another island
    assert island_state(fast, clock(), 8) == IslandState.LATE  # two rounds went by without it
    slow, _ = m.join("slow", num_ranks=1, session_id="s", round_=0)
    slow.last_committed_round, slow.holds_round = 2, 3
    assert island_state(slow, clock(), 7) == IslandState.LATE  # at work on θ_3
    slow.holds_round = 6  # pulled the newest θ, but its last push that counted was for round 2
    assert island_state(slow, clock(), 7) == IslandState.LATE
    slow.last_committed_round = 6
    assert island_state(slow, clock(), 7) == IslandState.ACTIVE  # it made the last round itself


def test_joiners_that_never_push_are_forgotten_when_their_lease_ends_and_reasons_stay_a_line():
    """Hardening round 5, item 10: 3,000 islands that joined and never pushed were kept for good
    (/api/status 1 MB) and every join logged the whole waiting list (the log reached 65 MB)."""
    from atoll.coordinator.policy.rounds import IslandView, RoundPolicy, RoundView, decide
    from atoll.coordinator.run.decider import waiting_key

    now = [0.0]
    m = Membership(lambda: now[0], lambda: 10.0)
    worker, _ = m.join("worker", num_ranks=1, session_id="s", round_=0)
    worker.last_committed_round, worker.rounds_committed = 0, 1
    for i in range(3000):
        m.join(f"ghost-{i:04d}", num_ranks=1, session_id=f"g{i}", round_=0)
    view = RoundView(
        round=1,
        opened_at=0.0,
        islands=tuple(IslandView(island_id=i, lease_expires_at=r.lease_expires_at, committed=False)
                      for i, r in m.islands.items()),
    )  # fmt: skip
    _, reason = decide(1.0, view, RoundPolicy(quorum=1, deadline_seconds=600.0))
    assert len(reason) < 300 and "and 2,993 more" in reason, reason
    fewer = RoundView(round=1, opened_at=0.0, islands=view.islands[:-1])
    assert waiting_key(view, 1.0) == waiting_key(fewer, 1.0)  # one more joiner among thousands: no new line
    now[0] = 11.0  # their leases ran out: still members (a stall names them, an operator may evict them)...
    assert len(m.newly_expired()) == 3001
    forgotten = m.forget_silent()  # ...but past 256 gone records of islands that never pushed, the oldest go
    assert len(forgotten) == 3000 - 256 and len(m.islands) == 1 + 256
    now[0] = 11.0 + 100.0  # and once gone for 10 leases (at least 60 s), all of them
    assert len(m.forget_silent()) == 256
    assert list(m.islands) == ["worker"] and len(m.past_goodput) == 3000
    m.join("ghost-0001", num_ranks=1, session_id="g1b", round_=1)  # one that comes back joins as new
    assert "ghost-0001" in m.islands


def test_a_relays_goodput_is_its_islands_each_from_its_join_at_the_relay_and_kept_when_the_relay_leaves():
    """(Before: the root kept one goodput for a relay: its islands' compute together over the relay's
    own time joined, 1.0 (clipped) for a relay of three busy islands, and no figure for any island.)"""
    from atoll.coordinator.policy.goodput import run_goodput
    from atoll.coordinator.state.membership import relayed

    m, clock = membership()
    relay, _ = m.join("eu", num_ranks=1, session_id="s", round_=0, relay=True)
    alone, _ = m.join("a", num_ranks=1, session_id="t", round_=0)
    assert relay.goodput is None and relay.stands_for is None  # (how many islands it stands for: not known yet)
    assert alone.stands_for == 1
    clock.now = 110.0  # eu's first push: x joined at eu 10 s ago, y 4 s ago; x computed 5 s, y 4 s
    relayed(relay, [("eu/x", 10.0, 5.0, 50), ("eu/y", 4.0, 4.0, 40)], clock())
    alone.entered(0, now=clock(), usual_weight=1.0, compute_seconds=10.0, blocked_seconds=0.0, tokens=9, on_time=None)
    assert relay.stands_for == 2
    assert {k: (g.ratio(clock()), g.tokens_into_theta) for k, g in relay.behind.items()} == {
        "eu/x": (0.5, 50),
        "eu/y": (1.0, 40),
    }
    assert run_goodput(m.goodput(), clock()) == pytest.approx((5 + 4 + 10) / (10 + 4 + 10))  # x, y and a
    clock.now = 120.0
    relayed(relay, [("eu/x", 0.0, 5.0, 50)], clock())  # x re-joined its relay: its earlier time still counts
    assert relay.behind["eu/x"].ratio(clock()) == pytest.approx(10 / 20) and relay.stands_for == 1
    clock.now = 150.0  # no push since: each island's figure is as of its last push (the root does not see an
    # island leave its relay; a wall running on to now fell for good once the run was done, to 3% in a trial)
    assert {k: g.ratio(clock()) for k, g in relay.behind.items()} == {"eu/x": 0.5, "eu/y": 1.0}
    saved = m.to_json()["islands"]
    restored = Membership(clock, lambda: 10.0)
    restored.restore(saved, {})
    assert (restored.islands["eu"].stands_for, restored.islands["a"].stands_for) == (1, 1)
    assert restored.islands["eu"].goodput is None and restored.islands["eu"].relay
    m.leave("eu")
    clock.now = 200.0
    assert m.left_goodput("eu/x").ratio(clock()) == pytest.approx(10 / 20)  # (kept once its relay left)
    assert run_goodput(m.goodput(), clock()) == pytest.approx((10 + 4 + 10) / (20 + 4 + 100))
