"""An island's wait for an outer step, as one state machine with named states: pure transitions, driven
by :meth:`~atoll.islands._transport.session.Session.pull_until_ready` (which does the I/O) and tested
by feeding them answers, no sockets.

States (:class:`WaitStage`):

- WAITING: long-polls for the outer step past ``have_round``;
- RESYNCING: an update broke off half-applied (a tentative update whose round was never saved: the
  coordinator died, or its save failed; or a corrupt one): pulls the full θ, which is the round's
  start again (θ_start was only ever changed by that update, the parameters not at all) or θ of a
  later round;
- CATCHING_UP: applied an update, and the run is further: pulls the next one at once.

Each answer gives the next state and what to do (:class:`Act`): pull again (or ask at once), re-push (the coordinator
has no push of ours for the round: it restarted), upload θ_0 (the bootstrap claim passed to us),
done, the run is complete, give up (the last round can never close), or fail (updates keep breaking).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, replace

from atoll.islands._messages import Update
from atoll.protos.vocabulary import UpdateKind

MAX_RESYNCS = 3
"""Full-θ pulls after a broken update before giving up (a coordinator sending corrupt data)."""


class WaitStage(enum.Enum):
    WAITING = "waiting"
    RESYNCING = "resyncing"
    CATCHING_UP = "catching_up"


class Act(enum.Enum):
    PULL = "pull"
    ASK = "ask"
    """Pull at once, without the long-poll: the round we waited on is open again (the coordinator lost
    its update); a coordinator that took over from a dead one has no push of ours and says so only
    when a pull ends."""
    REPUSH = "repush"
    UPLOAD = "upload"
    DONE = "done"
    COMPLETE = "complete"
    """The run completed with this island already holding its final θ."""
    GIVE_UP = "give_up"
    """Its last round can never close: fewer islands committed or live than the quorum."""
    FAIL = "fail"


@dataclass(frozen=True)
class Wait:
    stage: WaitStage
    have_round: int
    """What the next pull asks past (-1: the full θ)."""
    lost: int | None = None
    """The round whose update broke, until the full θ says whether the coordinator kept it."""
    resyncs: int = 0
    may_repush: bool = True
    """A push of ours for ``have_round`` may be sent again (none once the round closed without it)."""


def start(have_round: int, *, can_repush: bool) -> Wait:
    return Wait(WaitStage.WAITING, have_round, may_repush=can_repush)


def broken(w: Wait) -> tuple[Wait, Act]:
    """An update broke off half-applied: pull the full θ, unless updates keep breaking."""
    if w.resyncs + 1 > MAX_RESYNCS:
        return w, Act.FAIL
    lost = w.have_round if w.lost is None else w.lost  # a resync that breaks too: still that round's fate
    return Wait(WaitStage.RESYNCING, -1, lost, w.resyncs + 1, w.may_repush), Act.PULL


def answered(w: Wait, u: Update, *, can_upload: bool, last: bool) -> tuple[Wait, Act]:
    """The coordinator's answer to a pull (an update's entries are applied by then)."""
    if u.kind is UpdateKind.NOT_READY:
        if u.bootstrap and can_upload:
            return w, Act.UPLOAD
        if u.run_complete and u.round == w.have_round:
            return w, Act.COMPLETE
        if u.stalled and last:
            return w, Act.GIVE_UP
        if w.may_repush and not u.committed and u.round == w.have_round:
            return w, Act.REPUSH
        return w, Act.PULL
    if u.kind is UpdateKind.FULL and w.lost is not None and w.lost >= 0 and u.round == w.lost:
        # The coordinator lost the round whose update broke: it is open again; wait for it (re-pushing).
        return Wait(WaitStage.WAITING, w.lost, None, w.resyncs, w.may_repush), Act.ASK
    if u.round < u.latest_round:  # several rounds behind: the next delta right away
        return Wait(WaitStage.CATCHING_UP, u.round, None, w.resyncs, may_repush=False), Act.PULL
    return Wait(WaitStage.WAITING, u.round, None, w.resyncs, w.may_repush), Act.DONE


def repushed(w: Wait, round_closed: bool) -> Wait:
    """Our push was sent again; a round that closed without it takes no more of it."""
    return replace(w, may_repush=w.may_repush and not round_closed)
