"""The pure round decision: states built by hand, the clock moved by hand."""

from __future__ import annotations

import pytest

from atoll.coordinator.policy.rounds import Decision, IslandView, RoundPolicy, RoundView, decide, next_wakeup, stall
from atoll.coordinator.state.membership import island_state

POLICY = RoundPolicy(quorum=2, deadline_seconds=10.0)


def view(*islands, opened_at=0.0):
    return RoundView(
        round=3,
        opened_at=opened_at,
        islands=tuple(IslandView(island_id=i, lease_expires_at=lease, committed=c) for i, lease, c in islands),
    )


def test_closes_when_every_live_island_committed():
    d, reason = decide(1.0, view(("a", 100, True), ("b", 100, True)), POLICY)
    assert d is Decision.CLOSE and "all 2 live islands committed" in reason


def test_waits_for_live_straggler_until_deadline():
    state = view(("a", 100, True), ("b", 100, True), ("c", 100, False))
    d, reason = decide(9.9, state, POLICY)
    assert d is Decision.WAIT and "waiting for c" in reason
    assert next_wakeup(9.9, state, POLICY) == 10.0
    d, reason = decide(10.0, state, POLICY)
    assert d is Decision.CLOSE and "deadline" in reason and "not waiting for c" in reason


def test_expired_lease_is_not_waited_for():
    state = view(("a", 100, True), ("b", 100, True), ("c", 5.0, False))
    assert decide(4.0, state, POLICY)[0] is Decision.WAIT
    assert next_wakeup(4.0, state, POLICY) == 5.0
    assert decide(5.0, state, POLICY)[0] is Decision.CLOSE


def test_never_closes_below_quorum_even_after_deadline():
    d, reason = decide(1000.0, view(("a", 2000, True), ("b", 1.0, False)), POLICY)
    assert d is Decision.WAIT and "1 of quorum 2" in reason


def test_no_commits_waits():
    d, _ = decide(50.0, view(("a", 100, False), ("b", 100, False)), RoundPolicy(quorum=1, deadline_seconds=1))
    assert d is Decision.WAIT


def test_island_states():
    from atoll.coordinator.state.membership import IslandRecord

    rec = IslandRecord("a", 1, lease_expires_at=10.0, joined_round=3)
    assert island_state(rec, 1.0, 3) == "joining"
    rec.holds_round = 3
    assert island_state(rec, 1.0, 3) == "late"  # holds θ_3 but did not take part in round 2
    rec.last_committed_round = 2
    assert island_state(rec, 1.0, 3) == "active"
    assert island_state(rec, 1.0, 5) == "late"  # missed rounds 3 and 4
    assert island_state(rec, 10.0, 5) == "gone"


# ---- rounds.stall -----------------------------------------------------------------------------
def test_stall_says_what_would_unblock_the_round():
    islands = (
        IslandView(island_id="a", lease_expires_at=50.0, committed=True),
        IslandView(island_id="b", lease_expires_at=5.0, committed=False),
    )
    state = RoundView(round=4, opened_at=0.0, islands=islands)
    policy = RoundPolicy(quorum=2, deadline_seconds=10.0)
    assert stall(4.0, state, policy) is None  # b is still alive
    why = stall(6.0, state, policy)
    assert "cannot reach quorum 2" in why and "gone: b" in why and "--quorum 1" in why
    assert stall(6.0, RoundView(round=4, opened_at=0.0, islands=()), policy) is None  # nobody there yet


def test_a_waiting_round_is_logged_when_it_changes_and_reminded_every_30_seconds():
    """(Before: "round 817: 1 committed, waiting for site-a (585.4s to deadline)" every second, about
    600 lines per waiting round, since the countdown changed the text.)"""
    from atoll.coordinator.run.decider import Reminder, waiting_key

    policy = RoundPolicy(quorum=1, deadline_seconds=600.0)
    r, logged = Reminder(every=30.0), []
    for t in range(600):  # a.committed, b live and missing for ten minutes; decide's text changes each second
        v = RoundView(
            round=817,
            opened_at=0.0,
            islands=(
                IslandView(island_id="a", lease_expires_at=1e9, committed=True),
                IslandView(island_id="b", lease_expires_at=1e9, committed=False),
            ),
        )
        decide(float(t), v, policy)
        if r.due(float(t), waiting_key(v, float(t))):
            logged.append(t)
    assert logged == list(range(0, 600, 30))
    v = RoundView(round=817, opened_at=0.0, islands=(IslandView(island_id="a", lease_expires_at=1e9, committed=True),))
    assert r.due(600.5, waiting_key(v, 600.5))  # b left: a change, logged at once


def test_a_stall_is_warned_about_once_it_lasted_a_lease_and_its_end_is_said():
    """(Before: "cannot reach quorum" at WARNING at every start, while the second island was still
    joining, and at every normal end, while islands left.)"""
    import logging

    from atoll.coordinator.run.decider import StallReport

    r = StallReport()
    assert r.update(0.0, "stuck", grace=30.0) is None  # at start: the other island is on its way
    assert r.update(10.0, None, grace=30.0) is None  # it joined: never warned, nothing to say
    assert r.update(20.0, "stuck", grace=30.0) is None
    assert r.update(50.0, "stuck", grace=30.0) == (logging.WARNING, "stuck")
    assert r.update(80.0, "stuck", grace=30.0) is None  # once
    assert r.update(90.0, None, grace=30.0) == (logging.INFO, "the round can reach quorum again")


# ---- the grace window after quorum -----------------------------
def test_arrivals_are_tracked_as_a_smoothed_mean_and_deviation():
    from atoll.coordinator.policy.grace import Arrival

    a = Arrival()
    assert a.expected() is None
    a.observe(10.0)
    assert (a.mean, a.dev, a.expected()) == (10.0, 5.0, 30.0)
    a.observe(12.0)  # err 2: mean += 2/8, dev += (2 - 5)/4
    assert (a.mean, a.dev) == (10.25, 4.25) and a.expected() == 27.25


def view_with(now_committed: dict, missing: dict, opened_at: float = 0.0, round_: int = 7) -> RoundView:
    islands = tuple(
        IslandView(island_id=i, lease_expires_at=1e9, committed=True, committed_at=t) for i, t in now_committed.items()
    ) + tuple(IslandView(island_id=i, lease_expires_at=1e9, committed=False, expected=e) for i, e in missing.items())
    return RoundView(round=round_, opened_at=opened_at, islands=islands)


def test_a_stalled_but_live_island_does_not_hold_a_quorum_round_beyond_its_grace():
    """(Before: a round with quorum waited for a live straggler until --round-deadline-seconds, 600 s
    by default, however early the straggler used to arrive.)"""
    policy = RoundPolicy(quorum=2, deadline_seconds=600.0, grace="auto")
    v = view_with({"a": 10.0, "b": 11.0}, {"c": 12.5})  # c usually commits by +12.5 s
    assert decide(12.0, v, policy)[0] is Decision.WAIT
    assert next_wakeup(11.0, v, policy) == 12.5
    decision, reason = decide(12.5, v, policy)
    assert decision is Decision.CLOSE
    assert reason == "round 7: grace 1.5s after quorum: c expected at +12.5s; c did not come"


def test_without_history_the_grace_is_the_deadline_and_a_fixed_window_or_off_are_honoured():
    missing_new = view_with({"a": 1.0}, {"new": None})
    auto = RoundPolicy(quorum=1, deadline_seconds=60.0, grace="auto")
    assert decide(59.0, missing_new, auto)[0] is Decision.WAIT  # no ground to cut the wait short
    assert "deadline 60s passed" in decide(60.0, missing_new, auto)[1]
    fixed = RoundPolicy(quorum=1, deadline_seconds=60.0, grace=5.0)
    assert decide(5.9, missing_new, fixed)[0] is Decision.WAIT and decide(6.0, missing_new, fixed)[0] is Decision.CLOSE
    off = RoundPolicy(quorum=1, deadline_seconds=60.0, grace="off")
    assert decide(59.0, view_with({"a": 1.0}, {"c": 2.0}), off)[0] is Decision.WAIT
    assert decide(2.0, view_with({"a": 1.0}, {"c": 2.0}), auto)[0] is Decision.CLOSE


def test_a_decoupled_round_waits_neither_for_islands_behind_nor_past_the_quorums_slack():
    """Decoupled: an island still training on an older θ pushes for an older round (folded, never
    committed here), so it is not waited for; and the grace ends at half the shortest cycle of the
    committed islands (the time between their pushes, on the coordinator's clock) after the quorum,
    before they are due to push again (they never wait, but a round kept open makes their next pushes
    later)."""
    policy = RoundPolicy(quorum=2, deadline_seconds=600.0, grace="auto", decoupled=True)
    islands = (
        IslandView(island_id="a", lease_expires_at=1e9, committed=True, committed_at=10.0, cycle_seconds=12.0),
        IslandView(island_id="b", lease_expires_at=1e9, committed=True, committed_at=11.0, cycle_seconds=8.0),
        IslandView(island_id="slow", lease_expires_at=1e9, committed=False, behind=True),
    )
    v = RoundView(round=7, opened_at=0.0, islands=islands)
    decision, reason = decide(11.0, v, policy)
    assert decision is Decision.CLOSE and reason == "round 7: all 2 live islands committed"
    sync = RoundPolicy(quorum=2, deadline_seconds=600.0, grace="auto")
    assert decide(11.0, v, sync)[0] is Decision.WAIT  # in sync mode it is waited for (it catches up)

    fresh = IslandView(island_id="new", lease_expires_at=1e9, committed=False)  # holds θ_7, no history
    v = RoundView(round=7, opened_at=0.0, islands=(*islands, fresh))
    assert decide(14.9, v, policy)[0] is Decision.WAIT and next_wakeup(11.0, v, policy) == 15.0
    decision, reason = decide(15.0, v, policy)
    assert decision is Decision.CLOSE
    assert reason == "round 7: grace 4s after quorum (half the quorum's cycle: 4s; at least 0.25s); new did not come"
    assert decide(15.0, v, sync)[0] is Decision.WAIT  # sync: no history, wait until the deadline


def test_a_decoupled_round_of_short_cycles_waits_a_quarter_second_not_a_second_for_a_slow_island():
    """H=10 on the map's machine: the fast islands push every ~0.22 s, and a slow island (4x) is
    expected 0.9 s after the quorum. Half the quorum's cycle is 0.11 s; the grace ends at the floor,
    0.25 s after the quorum, and the round closes without it (its push is folded into the next). With
    a floor of 1 s every such round waited for it, the fast islands' deltas grew to 6-12 H steps, and
    at speeds 1:1:4 θ's loss at equal tokens was 7-19% higher (benchmarks/RESULTS.md)."""
    policy = RoundPolicy(quorum=2, deadline_seconds=600.0, grace="auto", decoupled=True)
    islands = (
        IslandView(island_id="a", lease_expires_at=1e9, committed=True, committed_at=10.0, cycle_seconds=0.22),
        IslandView(island_id="b", lease_expires_at=1e9, committed=True, committed_at=10.05, cycle_seconds=0.23),
        IslandView(island_id="slow", lease_expires_at=1e9, committed=False, expected=10.9),
    )
    v = RoundView(round=7, opened_at=9.8, islands=islands)
    assert decide(10.29, v, policy)[0] is Decision.WAIT and next_wakeup(10.1, v, policy) == pytest.approx(10.3)
    decision, reason = decide(10.3, v, policy)
    assert decision is Decision.CLOSE
    assert reason == (
        "round 7: grace 0.25s after quorum (half the quorum's cycle: 0.11s; at least 0.25s); slow did not come"
    )


def test_a_decoupled_first_round_waits_half_the_quorums_time_to_its_push_not_for_every_island():
    """(Round 0 of a decoupled run knew no island's cycle, so its grace had no cap: it waited for the
    slowest island's first H steps, 23.4 s of a 45-s run at speeds 1:2:4:8, H=100, while the fast
    islands' deltas grew to 13x H steps.) With no cycle known, the quorum's time from the round's
    opening to its push stands for one: a commits 20 s in, so the round closes 10 s later without b
    and c (no history; their pushes will be folded). Sync mode still waits until the deadline."""
    policy = RoundPolicy(quorum=1, deadline_seconds=600.0, grace="auto", decoupled=True)
    islands = (
        IslandView(island_id="a", lease_expires_at=1e9, committed=True, committed_at=25.0),
        IslandView(island_id="b", lease_expires_at=1e9, committed=False),
        IslandView(island_id="c", lease_expires_at=1e9, committed=False),
    )
    v = RoundView(round=0, opened_at=5.0, islands=islands)
    assert decide(34.9, v, policy)[0] is Decision.WAIT and next_wakeup(25.0, v, policy) == 35.0
    decision, reason = decide(35.0, v, policy)
    assert decision is Decision.CLOSE
    assert reason == (
        "round 0: grace 10s after quorum (half the quorum's time to its push: 10s; at least 0.25s); b, c did not come"
    )
    sync = RoundPolicy(quorum=1, deadline_seconds=600.0, grace="auto")
    assert decide(35.0, v, sync)[0] is Decision.WAIT


def test_a_quorum_counts_the_islands_behind_a_relay_not_its_one_push():
    """(Before: a relay's push for four islands counted one toward the quorum: a root with --quorum 3
    and two relays of two islands each waited for both relays, and a relay of five counted less than
    two islands of its own.)"""
    policy = RoundPolicy(quorum=3, deadline_seconds=60.0, grace=5.0)
    eu = IslandView(island_id="eu", lease_expires_at=100.0, committed=True, committed_at=2.0, counts=4)
    us = IslandView(island_id="us", lease_expires_at=100.0, committed=False, counts=2)
    decision, reason = decide(3.0, RoundView(round=1, opened_at=0.0, islands=(eu, us)), policy)
    assert decision is Decision.WAIT and reason.startswith("round 1: 4 committed, waiting for us")
    assert decide(7.0, RoundView(round=1, opened_at=0.0, islands=(eu, us)), policy)[0] is Decision.CLOSE  # +5 s
    a = IslandView(island_id="a", lease_expires_at=100.0, committed=True, committed_at=1.0)
    two = IslandView(island_id="us", lease_expires_at=100.0, committed=True, committed_at=4.0, counts=2)
    state = RoundView(round=1, opened_at=0.0, islands=(a, two, IslandView(island_id="b", lease_expires_at=100.0,
                                                                            committed=False)))  # fmt: skip
    assert next_wakeup(5.0, state, policy) == 9.0  # the quorum came at +4 s, with the relay's two
    gone = IslandView(island_id="eu", lease_expires_at=1.0, committed=False, counts=4)
    assert stall(2.0, RoundView(round=1, opened_at=0.0, islands=(gone, us)), policy).startswith(
        "round 1 cannot reach quorum 3: 2 island(s) committed or alive (us)"
    )
    assert stall(0.5, RoundView(round=1, opened_at=0.0, islands=(gone, us)), policy) is None  # eu's four alive
    # A relay that has not pushed yet may stand for any number of islands: no stall is claimed for it
    # (before: "round 0 cannot reach quorum 2: 1 island(s) ... (relay-0)" while its two islands trained).
    new = IslandView(island_id="eu", lease_expires_at=100.0, committed=False, counts=None)
    assert stall(2.0, RoundView(round=0, opened_at=0.0, islands=(new,)), policy) is None
    assert decide(2.0, RoundView(round=0, opened_at=0.0, islands=(new,)), policy)[0] is Decision.WAIT
