"""An island's wait for an outer step (a tentative update, a broken one, a lost round, a catch-up) as a
state machine: its transitions driven by hand with the coordinator's answers, no sockets."""

from __future__ import annotations

from atoll.islands._messages import Update
from atoll.islands._transport import waiting
from atoll.islands._transport.waiting import MAX_RESYNCS, Act, WaitStage
from atoll.protos.vocabulary import UpdateKind


def not_ready(round_: int, **kw) -> Update:
    return Update(UpdateKind.NOT_READY, round_, latest_round=round_, **kw)


def delta(round_: int, latest: int | None = None) -> Update:
    return Update(UpdateKind.DELTA, round_, latest_round=round_ if latest is None else latest)


def full(round_: int) -> Update:
    return Update(UpdateKind.FULL, round_, latest_round=round_)


def answer(w, u, *, can_upload=False, last=False):
    return waiting.answered(w, u, can_upload=can_upload, last=last)


def test_a_wait_ends_at_the_outer_step_past_its_round():
    w = waiting.start(3, can_repush=True)
    w, act = answer(w, not_ready(3, committed=True))
    assert act is Act.PULL and (w.stage, w.have_round) == (WaitStage.WAITING, 3)
    w, act = answer(w, delta(4))
    assert act is Act.DONE and w.have_round == 4


def test_a_tentative_update_that_broke_resyncs_and_a_lost_round_is_waited_for_again_with_a_repush():
    """The coordinator died while round 3's tentative update streamed: the island, having applied some
    entries, pulls the full θ; it is θ_3 (the round was never saved), so it asks about round 3 again at
    once (ASK: no long-poll, since a standby that took over has no push of ours and says so only when a
    pull ends) and, told the coordinator has no push of its, pushes again."""
    w = waiting.start(3, can_repush=True)
    w, act = waiting.broken(w)
    assert act is Act.PULL and (w.stage, w.have_round, w.lost) == (WaitStage.RESYNCING, -1, 3)
    w, act = answer(w, full(3))
    assert act is Act.ASK and (w.stage, w.have_round, w.lost) == (WaitStage.WAITING, 3, None)
    w, act = answer(w, not_ready(3, committed=False))
    assert act is Act.REPUSH
    w = waiting.repushed(w, round_closed=False)
    w, act = answer(w, not_ready(3, committed=True))
    assert act is Act.PULL
    w, act = answer(w, delta(4))
    assert act is Act.DONE and w.have_round == 4


def test_a_broken_update_whose_round_was_kept_ends_on_the_full_theta():
    w, _ = waiting.broken(waiting.start(3, can_repush=True))
    w, act = answer(w, full(4))
    assert act is Act.DONE and w.have_round == 4


def test_a_resync_that_breaks_too_still_waits_on_the_first_lost_round():
    w, _ = waiting.broken(waiting.start(3, can_repush=True))
    w, _ = waiting.broken(w)
    assert (w.have_round, w.lost, w.resyncs) == (-1, 3, 2)
    w, act = answer(w, full(3))
    assert act is Act.ASK and w.have_round == 3


def test_updates_that_keep_breaking_fail():
    w = waiting.start(3, can_repush=True)
    for _ in range(MAX_RESYNCS):
        w, act = waiting.broken(w)
        assert act is Act.PULL
    assert waiting.broken(w)[1] is Act.FAIL


def test_an_island_behind_catches_up_one_delta_at_a_time_without_repushing():
    w = waiting.start(5, can_repush=True)
    w, act = answer(w, delta(6, latest=8))
    assert act is Act.PULL and (w.stage, w.have_round, w.may_repush) == (WaitStage.CATCHING_UP, 6, False)
    w, act = answer(w, delta(7, latest=8))
    assert act is Act.PULL and w.have_round == 7
    w, act = answer(w, delta(8, latest=8))
    assert act is Act.DONE and w.have_round == 8


def test_a_round_closed_without_our_push_is_not_repushed_again():
    w = waiting.start(3, can_repush=True)
    _, act = answer(w, not_ready(3, committed=False))
    assert act is Act.REPUSH
    w = waiting.repushed(w, round_closed=True)
    assert answer(w, not_ready(3, committed=False))[1] is Act.PULL
    assert answer(waiting.start(3, can_repush=False), not_ready(3))[1] is Act.PULL  # nothing to repush


def test_bootstrap_claim_run_complete_and_a_stalled_last_round():
    w = waiting.start(-1, can_repush=False)
    assert answer(w, not_ready(0, bootstrap=True), can_upload=True)[1] is Act.UPLOAD
    assert answer(w, not_ready(0, bootstrap=True), can_upload=False)[1] is Act.PULL
    w = waiting.start(9, can_repush=False)
    assert answer(w, not_ready(9, run_complete=True))[1] is Act.COMPLETE
    assert answer(w, not_ready(9, stalled=True), last=True)[1] is Act.GIVE_UP
    assert answer(w, not_ready(9, stalled=True), last=False)[1] is Act.PULL  # islands may come back
