"""Who takes part in the run: islands, their leases and sessions, departures, the bootstrap claim.

Pure bookkeeping with an injected clock (no gRPC, no tensors): tests build it by hand and move the
clock, as they do for ``rounds.decide``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

from atoll.coordinator.errors import Reason, refuse
from atoll.coordinator.messages import TensorDecl
from atoll.coordinator.policy.goodput import Goodput
from atoll.coordinator.policy.grace import Arrival

log = logging.getLogger("atoll.coordinator")


FORGET_AFTER_LEASES = 10
FORGET_FLOOR_SECONDS = 60.0
MAX_SILENT = 256
"""Gone islands that never committed a push kept at most (:meth:`Membership.forget_silent`)."""


class IslandState:
    JOINING = "joining"
    """Joined, has not received θ yet."""
    ACTIVE = "active"
    """Took part in the last closed round, or holds the θ it produced and took part in the round
    before (a round other islands closed without it while it worked: quorum below the islands)."""
    LATE = "late"
    """Alive (lease current) but its work is not arriving: a straggler, or catching up."""
    GONE = "gone"
    """Lease expired: not waited for; re-joins by itself when it comes back."""
    LEFT = "left"
    """Called Leave: no longer a member (may join again)."""
    EVICTED = "evicted"
    """Removed by an operator for good: its joins are refused."""


@dataclass
class IslandRecord:
    island_id: str
    num_ranks: int
    lease_expires_at: float
    joined_round: int
    rounds_committed: int = 0
    holds_round: int = -1
    """The newest θ version this island pulled (-1: none yet)."""
    last_committed_round: int = -1
    """The newest round its push committed in, for that round (-1: none)."""
    last_entered_round: int = -1
    """The newest round its work entered θ in: committed for it, or folded into it (-1: none)."""
    session_id: str = ""
    """The process holding this island id ("" until a session joins: restored, or an old client)."""
    tensors: tuple[TensorDecl, ...] = ()
    """The model the island declared at its join (checked against θ_0 once that exists)."""
    layout_digest: str = ""
    last_push_at: float | None = None
    """Clock time of its last committed push."""
    arrival: Arrival = field(default_factory=Arrival)
    """When in a round its push commits (the grace window waits for it that long)."""
    cycle: Arrival = field(default_factory=Arrival)
    """The time between its pushes that count (committed or folded), as the coordinator's clock sees
    it: a decoupled round's grace is bounded by the quorum's (never by what an island reports)."""
    goodput: Goodput | None = None
    """Its compute into θ and its time while joined (set at the join)."""
    usual_weight: float = 0.0
    """The weight of its last contribution that counted, not down-weighted for lateness: what it
    brings to a round (a decoupled round's share is its weight over the live islands' together)."""
    arrival_offset: tuple[int, float] | None = None
    """Decoupled runs: (round, seconds) its fresh push in that round committed after the median of the
    round's fresh pushes (:mod:`atoll.coordinator.policy.phase`), for its pull of that round's update."""
    relay: bool = False
    """It is a relay (``atoll relay``): its pushes carry the sum of its own islands'."""
    stands_for: int | None = 1
    """The islands its pushes count for in a quorum: a relay's, those its last push that entered named
    (None: a relay that has not pushed yet)."""
    behind: dict[str, Goodput] = field(default_factory=dict)
    """A relay's islands (``relay/island``, through relays below it too): their compute into θ and
    their time joined, as its pushes report them."""
    expiry_logged: bool = field(default=False, repr=False)

    def entered(
        self,
        round_: int,
        *,
        now: float,
        usual_weight: float,
        compute_seconds: float,
        blocked_seconds: float,
        tokens: int,
        on_time: tuple[int, float] | None,
    ) -> None:
        """Its push entered θ in the open round ``round_`` at ``now``, weighing ``usual_weight`` not
        down-weighted for lateness, with the compute it reported; ``on_time``: (the round it was for,
        when that round opened) for a push that committed on time, None for one folded late."""
        self.usual_weight = usual_weight
        if self.last_push_at is not None:
            self.cycle.observe(now - self.last_push_at)
        self.last_push_at = now
        if self.goodput is not None:
            self.goodput.entered(compute_seconds, blocked_seconds, tokens)
        self.rounds_committed += 1  # (a folded delta entered θ too: a slow island showed 0 rounds all run)
        self.last_entered_round = round_
        if on_time is not None:
            self.last_committed_round, opened_at = on_time
            self.arrival.observe(now - opened_at)


def _stands_for(saved: dict) -> int | None:
    """A restored record's :attr:`IslandRecord.stands_for`."""
    if not saved.get("relay"):
        return 1
    return None if saved.get("stands_for") is None else int(saved["stands_for"])


def relayed(rec: IslandRecord, reports, now: float) -> None:
    """A push of relay ``rec`` entered θ, reporting ``reports``: (name, seconds joined at its relay,
    compute seconds, tokens) for each island behind it. It counts for that many islands in a quorum, and
    each island's goodput is as of its relay's last push that named it: its compute then, over its time
    from its join at its relay (the root's clock, less its seconds joined there; the earliest kept, so a
    gap while it was away counts against it) to that push. The root does not see an island leave its
    relay: a wall time running on to now would fall for good once the island is done."""
    rec.stands_for = max(len(reports), 1)
    for name, joined_seconds, compute_seconds, tokens in reports:
        joined_at = now - max(joined_seconds, 0.0)
        g = rec.behind.get(name)
        if g is None:
            g = rec.behind[name] = Goodput(joined_at=joined_at, island=name)
        g.joined_at = min(g.joined_at, joined_at)
        g.left_at = now  # (its wall as of this push)
        g.entered(compute_seconds, 0.0, tokens)


def island_state(rec: IslandRecord, now: float, open_round: int) -> str:
    if rec.lease_expires_at <= now:
        return IslandState.GONE
    if rec.holds_round < 0 and max(rec.last_committed_round, rec.last_entered_round) < 0:
        return IslandState.JOINING
    if open_round == 0 or max(rec.last_committed_round, rec.last_entered_round) >= open_round - 1:
        return IslandState.ACTIVE  # (its work entered the last closed round: committed, or folded in)
    if rec.holds_round >= open_round - 1 and rec.last_committed_round >= rec.holds_round - 1:
        return IslandState.ACTIVE  # at work on the newest θ, its push for the round before counted
    return IslandState.LATE


def usual_weight(islands, now: float) -> float:
    """What a round of every live island would weigh: their last contributions' weights together."""
    return sum(rec.usual_weight for rec in islands if rec.lease_expires_at > now)


class Membership:
    def __init__(self, clock: Callable[[], float], lease_seconds: Callable[[], float]) -> None:
        """``lease_seconds``: read at every renewal (an operator may change it on a live run)."""
        self.clock = clock
        self.lease_seconds = lease_seconds
        self.islands: dict[str, IslandRecord] = {}
        self.departed: dict[str, str] = {}
        """Islands no longer members, by id: IslandState.LEFT or IslandState.EVICTED (persisted)."""
        self.bootstrapper: str | None = None
        """The island holding the claim to upload θ_0 (until θ_0 exists)."""
        self.bootstrap_open: Callable[[], bool] = lambda: True
        """Whether an island here may take the claim at all (a relay: only once its upstream gave it)."""
        self.past_goodput: list[Goodput] = []
        """The goodput of island records that left or were replaced (the run's value counts them)."""

    # ---- joins and leases ------------------------------------------------------------------
    def arrived(self, round_: int, offsets: dict[str, float]) -> None:
        """Round ``round_`` closed with these islands' fresh pushes ``offsets`` seconds from their median."""
        for island_id, offset in offsets.items():
            if (rec := self.islands.get(island_id)) is not None:
                rec.arrival_offset = (round_, offset)

    def offset_for(self, island_id: str, round_: int) -> float | None:
        """Where ``island_id``'s push landed in round ``round_`` (None: it had no fresh push there)."""
        rec = self.islands.get(island_id)
        if rec is None or rec.arrival_offset is None or rec.arrival_offset[0] != round_:
            return None
        return rec.arrival_offset[1]

    def holds(self, island_id: str, round_: int) -> None:
        """``island_id`` holds θ_round_ (it pulled it, or uploaded θ_0)."""
        rec = self.islands.get(island_id)
        if rec is not None:
            rec.holds_round = max(rec.holds_round, round_)

    def join(
        self,
        island_id: str,
        *,
        num_ranks: int,
        session_id: str,
        round_: int,
        tensors: tuple[TensorDecl, ...] = (),
        layout_digest: str = "",
        relay: bool = False,
    ) -> tuple[IslandRecord, bool]:
        """Register (or re-register) an island; returns its record and whether it is new (a fresh
        record: its staged pushes must be dropped)."""
        if self.departed.get(island_id) == IslandState.EVICTED:
            raise refuse(Reason.EVICTED, f"island {island_id!r} was evicted from the run by an operator")
        now = self.clock()
        rec = self.islands.get(island_id)
        if rec is not None and rec.session_id and session_id and rec.session_id != session_id:
            if rec.lease_expires_at > now:
                raise refuse(
                    Reason.SESSION_CONFLICT,
                    f"island id {island_id!r} is held by another live process (session {rec.session_id[:8]}, "
                    f"lease for {rec.lease_expires_at - now:.0f}s more): give each island process its own "
                    "--island-id, or stop the other one",
                )
            log.info("island %s: a new process (session %s) takes over an expired lease", island_id, session_id[:8])
            rec = None
        new = rec is None or rec.num_ranks != num_ranks
        old = self.islands.get(island_id)
        if new and old is not None:  # a new process, or a new layout
            self._retire(old, now)
        if new:  # (a relay's goodput is its islands': :attr:`IslandRecord.behind`)
            goodput = None if relay else Goodput(joined_at=now, island=island_id)
            rec = IslandRecord(island_id, num_ranks, now, round_, goodput=goodput, stands_for=None if relay else 1)
            self.islands[island_id] = rec
        rec.session_id = session_id or rec.session_id
        rec.tensors = tensors or rec.tensors
        rec.layout_digest = layout_digest or rec.layout_digest
        rec.relay = relay
        self.departed.pop(island_id, None)
        self.renew(rec)
        return rec, new

    def renew(self, rec: IslandRecord) -> None:
        rec.lease_expires_at = self.clock() + self.lease_seconds()
        rec.expiry_logged = False

    def touch(self, island_id: str, session_id: str = "") -> IslandRecord:
        """The record of a member making a call (its lease renewed); NOT_JOINED for an unknown island
        or a process whose session another one has taken over."""
        rec = self.islands.get(island_id)
        if rec is None or (session_id and rec.session_id and rec.session_id != session_id):
            if self.departed.get(island_id) == IslandState.EVICTED:
                raise refuse(Reason.EVICTED, f"island {island_id!r} was evicted from the run by an operator")
            raise refuse(Reason.NOT_JOINED, f"island {island_id!r} has not joined (or another process holds it)")
        self.renew(rec)
        return rec

    def leave(self, island_id: str) -> None:
        self._depart(island_id, IslandState.LEFT)

    def evict(self, island_id: str) -> None:
        if island_id not in self.islands and island_id not in self.departed:
            raise KeyError(island_id)
        self._depart(island_id, IslandState.EVICTED)

    def _depart(self, island_id: str, how: str) -> None:
        rec = self.islands.pop(island_id, None)
        if rec is not None:
            self._retire(rec, self.clock())
        self.departed[island_id] = how
        if self.bootstrapper == island_id:
            self.bootstrapper = None

    def _retire(self, rec: IslandRecord, now: float) -> None:
        """A record leaves: its goodput (a relay's: its islands', as of its last push) is kept for the
        run's, as of ``now``."""
        if rec.goodput is not None:
            rec.goodput.left_at = now
            self.past_goodput.append(rec.goodput)
        self.past_goodput.extend(rec.behind.values())

    def left_goodput(self, island_id: str) -> Goodput | None:
        """The goodput of ``island_id``'s newest record that left (None: none did)."""
        return next((g for g in reversed(self.past_goodput) if g.island == island_id), None)

    def goodput(self) -> list[Goodput]:
        """Every island record's goodput bookkeeping of the run: the members' and those that left."""
        live = [g for r in self.islands.values() for g in (r.goodput, *r.behind.values()) if g is not None]
        return self.past_goodput + live

    def newly_expired(self) -> list[IslandRecord]:
        """Members whose lease ran out since the last call (each reported once, for the log)."""
        now = self.clock()
        out = [r for r in self.islands.values() if r.lease_expires_at <= now and not r.expiry_logged]
        for r in out:
            r.expiry_logged = True
        return out

    def forget_silent(self) -> list[str]:
        """Drop the records of islands that never committed a push and whose lease ran out long ago
        (:data:`FORGET_AFTER_LEASES` leases, at least :data:`FORGET_FLOOR_SECONDS`), and past
        :data:`MAX_SILENT` such records the oldest: a joiner that never pushes is not kept for good
        (3,000 of them made /api/status 1 MB), while one that just went is still named in a stall and can
        be evicted. Their time while joined still counts in the run's goodput; each joins again if it
        comes back. Returns their ids."""
        now = self.clock()
        silent = sorted(
            (r for r in self.islands.values() if r.lease_expires_at <= now and not r.rounds_committed
             and r.last_committed_round < 0 and r.last_entered_round < 0),
            key=lambda r: r.lease_expires_at,
        )  # fmt: skip
        horizon = max(FORGET_AFTER_LEASES * self.lease_seconds(), FORGET_FLOOR_SECONDS)
        old = [r for r in silent if now - r.lease_expires_at >= horizon]
        drop = {r.island_id: r for r in [*silent[: max(0, len(silent) - MAX_SILENT)], *old]}
        for island_id, rec in drop.items():
            del self.islands[island_id]
            self._retire(rec, rec.lease_expires_at)
            if self.bootstrapper == island_id:
                self.bootstrapper = None
        return list(drop)

    def live(self) -> list[IslandRecord]:
        now = self.clock()
        return [r for r in self.islands.values() if r.lease_expires_at > now]

    # ---- bootstrap -------------------------------------------------------------------------
    def claim_bootstrap(self, island_id: str) -> bool:
        """Whether ``island_id`` holds (or now takes) the claim to upload θ_0. The claim moves on when
        its holder left, was evicted or let its lease lapse: the run's model is fixed by the θ_0 that
        arrives, never by a join."""
        if not self.bootstrap_open():
            return False  # a relay whose upstream holds θ_0 elsewhere: its islands get θ_0 from there
        holder = self.islands.get(self.bootstrapper) if self.bootstrapper else None
        if holder is None or holder.island_id == island_id or holder.lease_expires_at <= self.clock():
            if holder is not None and holder.island_id != island_id:
                log.warning("bootstrap claim of silent island %s passes to %s", holder.island_id, island_id)
            self.bootstrapper = island_id
        return self.bootstrapper == island_id

    # ---- persistence -----------------------------------------------------------------------
    def to_json(self) -> dict:
        return {
            "islands": {
                i.island_id: {
                    "num_ranks": i.num_ranks,
                    "joined_round": i.joined_round,
                    "rounds_committed": i.rounds_committed,
                    "last_committed_round": i.last_committed_round,
                    "last_entered_round": i.last_entered_round,
                    "arrival": i.arrival.to_json(),
                    "cycle": i.cycle.to_json(),
                    "usual_weight": i.usual_weight,
                    **({"relay": True, "stands_for": i.stands_for} if i.relay else {}),
                }
                for i in self.islands.values()
            },
            "departed": dict(sorted(self.departed.items())),
        }

    def restore(self, islands: dict[str, dict], departed: dict[str, str]) -> None:
        """Members from a snapshot, each with a fresh lease; departed islands stay out."""
        self.departed = dict(departed)
        now = self.clock()
        for island_id, rec in islands.items():
            if island_id in self.departed:
                continue
            self.islands[island_id] = IslandRecord(
                island_id,
                int(rec["num_ranks"]),
                now + self.lease_seconds(),
                int(rec["joined_round"]),
                int(rec["rounds_committed"]),
                last_committed_round=int(rec.get("last_committed_round", -1)),
                last_entered_round=int(rec.get("last_entered_round", rec.get("last_committed_round", -1))),
                arrival=Arrival.from_json(rec.get("arrival")),
                cycle=Arrival.from_json(rec.get("cycle")),
                goodput=None if rec.get("relay") else Goodput(joined_at=now, island=island_id),
                usual_weight=float(rec.get("usual_weight", 0.0)),  # (a decoupled round's share needs it)
                relay=bool(rec.get("relay", False)),
                stands_for=_stands_for(rec),  # (a quorum counts a relay's islands)
            )
