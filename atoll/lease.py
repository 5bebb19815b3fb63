"""One writer per run without a shared disk: the run's lease object in the store (``prefix/lease.json``)."""

from __future__ import annotations

import json
import logging
import math
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass

from atoll.objects import LEASE, Conflict, ObjectStore, StoreError

log = logging.getLogger("atoll.coordinator")


class Lease:
    """``prefix/lease.json``, held by one coordinator: created with a create-only PUT, renewed with a
    PUT conditional on the ETag it last wrote, taken over only once expired, and only by a PUT
    conditional on the ETag of the expired lease it read: of two coordinators that race for it, one
    write wins. A holder that fails to renew in time stops writing (:attr:`lost`; ``on_lost``).

    The expiry is the holder's wall clock plus ``seconds``; a contender waits ``skew`` more seconds on
    its own clock before it calls a lease expired (clocks of the two machines may differ by that;
    default: 5 s, or half the lease if that is shorter).
    Log records are written create-only too (:class:`~atoll.coordinator.disk.mirror.Mirror`): even
    a holder that missed its loss cannot write a round another one wrote."""

    def __init__(
        self,
        store: ObjectStore,
        seconds: float = 30.0,
        *,
        skew: float | None = None,
        clock: Callable[[], float] = time.time,
        monotonic: Callable[[], float] = time.monotonic,
        on_lost: Callable[[str], None] | None = None,
    ) -> None:
        if not 0 < seconds < math.inf:
            raise ValueError(f"a lease lasts a finite number of seconds > 0, got {seconds}")
        # Each lease request is given up after a sixth of the lease, tried once: a renewal attempt then
        # ends within a third of it, so a store that stalls is heard of (a WARNING, /healthz) well within
        # the lease, and a lapse is seen when it happens, not when the store answers again.
        self.store = store.within(max(0.5, seconds / 6))
        self.seconds, self.clock, self.monotonic, self.on_lost = seconds, clock, monotonic, on_lost
        self.skew = min(5.0, seconds / 2) if skew is None else skew
        self.owner = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self.etag: str | None = None
        self.lost: str | None = None
        """Why this coordinator no longer holds the lease (None while it does)."""
        self.trouble: str | None = None
        """Why the last renewal failed, while the lease still runs (None: renewed on time)."""
        self._renewed = 0.0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.timing = RenewalTiming()
        """How the renewals went (their PUTs' seconds, the longest the lease went unrenewed)."""

    def _body(self) -> bytes:
        now = self.clock()
        return json.dumps({"owner": self.owner, "expires": now + self.seconds, "seconds": self.seconds}).encode()

    def acquire(self) -> Lease:
        """Take the lease, or StoreError naming its holder and when it expires."""
        got = self.store.get(LEASE)
        started = self.monotonic()
        try:
            if got is None:
                self.etag = self.store.put_bytes(LEASE, self._body(), create_only=True)
            else:
                held = _read_lease(got[0], f"{self.store.url}/{LEASE}")
                expires = held["expires"]
                left = expires + self.skew - self.clock()
                if left > 0:
                    raise StoreError(
                        f"{self.store.url} is held by coordinator {held.get('owner', '?')} for {left:.0f} s more "
                        f"(its lease, {self.store.url}/{LEASE}); two coordinators never write one run: stop it, "
                        "or start this one once the lease has expired"
                    )
                self.etag = self.store.put_bytes(LEASE, self._body(), if_match=got[1])
                if expires:  # (0: given back by a clean stop)
                    log.warning(
                        "took over %s from coordinator %s (its lease expired)", self.store.url, held.get("owner")
                    )
        except Conflict:
            raise StoreError(f"{self.store.url}: another coordinator took the lease at the same moment") from None
        return self._renewing(started)

    def take_over(self, etag: str | None) -> Lease:
        """Take the lease a :class:`LeaseWatch` saw lapse (``etag``: the lease it read, None: there was
        none): a write conditional on that very lease, so of two standbys only one gets it, and a holder
        that renewed meanwhile keeps it (StoreError either way). No wait on the holder's clock: the watch
        measured the lapse on its own."""
        started = self.monotonic()
        try:
            if etag is None:
                self.etag = self.store.put_bytes(LEASE, self._body(), create_only=True)
            else:
                self.etag = self.store.put_bytes(LEASE, self._body(), if_match=etag)
        except Conflict:
            raise StoreError(f"{self.store.url}: the lease changed hands before this standby could take it") from None
        return self._renewing(started)

    def _renewing(self, started: float) -> Lease:
        """The lease was written at ``started`` (monotonic): keep it renewed from now on."""
        self._renewed = started
        self._thread = threading.Thread(target=self._renew_loop, name="atoll-lease", daemon=True)
        self._thread.start()
        return self

    def check(self) -> None:
        """StoreError unless the lease is held and was renewed within its time: before a durable write,
        and again once it is done (a write that outlasted the lease publishes nothing)."""
        if self.lost is None and self.monotonic() - self._renewed > self.seconds:
            self._lose(f"the lease was not renewed for {self.monotonic() - self._renewed:.0f} s")
        if self.lost is not None:
            raise StoreError(f"{self.store.url}: this coordinator no longer holds the run ({self.lost})")

    def renew(self) -> None:
        """Extend the lease by a write conditional on the last one (Conflict: someone took it). The
        lease counts from before the write (its expiry is written then), however long the PUT takes."""
        started = self.monotonic()
        try:
            self.etag = self.store.put_bytes(LEASE, self._body(), if_match=self.etag)
        except Conflict:
            self._lose("another coordinator took the lease")
            raise
        self.timing.renewed(self.monotonic() - started, started - self._renewed)
        self._renewed = started
        if self.trouble is not None:
            log.warning("renewed the lease on %s again", self.store.url)
            self.trouble = None

    def _renew_loop(self) -> None:
        while not self._stop.wait(self.seconds / 3):
            try:
                self.renew()
            except Conflict:
                return
            except StoreError as err:  # the store is unreachable: keep trying until the lease runs out
                left = max(self.seconds - (self.monotonic() - self._renewed), 0.0)
                self.trouble = (
                    f"the store does not answer: the lease was not renewed ({err}); it lapses in {left:.0f} s"
                )
                log.warning("could not renew the lease on %s (%s); it lapses in %.0f s", self.store.url, err, left)
                if left <= 0:
                    self._lose(f"the store was unreachable for {self.seconds:.0f} s")
                    return

    def lose(self, why: str) -> None:
        """This coordinator found out otherwise that another one writes the run (a record it was about to
        write exists): as a failed renewal."""
        self._lose(why)

    def _lose(self, why: str) -> None:
        if self.lost is None:
            self.lost = why
            log.error("%s: this coordinator lost the run's lease (%s); it stops writing", self.store.url, why)
            if self.on_lost is not None:
                self.on_lost(why)

    def release(self) -> None:
        """Stop renewing and give the lease back (a clean stop: the next coordinator need not wait)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self.lost is None and self.etag is not None:
            try:  # only our own lease: expire it with a conditional write (a delete is not conditional everywhere)
                expired = json.dumps({"owner": self.owner, "expires": 0}).encode()
                self.store.put_bytes(LEASE, expired, if_match=self.etag)
            except StoreError as err:
                log.warning("could not give back the lease on %s: %s", self.store.url, err)
        self.etag = None


def _read_lease(body: bytes, where: str) -> dict:
    """A lease's JSON, checked: one line naming the object when it is not a lease."""
    try:
        held = json.loads(body or b"{}")
        if not isinstance(held, dict):
            raise ValueError("not a JSON object")
        expires = float(held.get("expires", 0))
        if not math.isfinite(expires):
            raise ValueError(f"expires {expires}")
    except (ValueError, TypeError, RecursionError) as err:
        raise StoreError(f"{where} is not a lease atoll wrote ({err}); if no coordinator runs, delete it") from None
    return {**held, "expires": expires}


@dataclass
class RenewalTiming:
    """A holder's renewals, measured: how long each PUT took, and the longest a renewal came after the
    one before (counted as a standby counts: from the start of one PUT to the start of the next).
    ``/api/status`` shows it (``lease``) beside the lease's length."""

    renewals: int = 0
    put_seconds_max: float = 0.0
    put_seconds_total: float = 0.0
    unrenewed_seconds_max: float = 0.0

    def renewed(self, put_seconds: float, since_last: float) -> None:
        self.renewals += 1
        self.put_seconds_max = max(self.put_seconds_max, put_seconds)
        self.put_seconds_total += put_seconds
        self.unrenewed_seconds_max = max(self.unrenewed_seconds_max, since_last)

    def to_json(self, seconds: float) -> dict:
        mean = self.put_seconds_total / self.renewals if self.renewals else 0.0
        return {
            "seconds": seconds,
            "renewals": self.renewals,
            "put_seconds_mean": mean,
            "put_seconds_max": self.put_seconds_max,
            "unrenewed_seconds_max": self.unrenewed_seconds_max,
        }


DRIFT = 0.01
"""How much faster a holder's monotonic clock may run than a standby's, as a fraction (NTP keeps
servers' rates within 500 ppm, 0.05%; a standby waits 1% more than the lease)."""


@dataclass(frozen=True)
class Seen:
    """What one read of the lease found: its ETag (None: no lease object), whether it was given back,
    the holder and its lease length, and how many seconds more this reader waits before calling it
    lapsed (0: it has lapsed: take it)."""

    etag: str | None
    owner: str
    seconds: float
    left: float


class LeaseWatch:
    """A standby's view of the run's lease, measured on its own clock (no wall clock, so no skew
    between machines): a lease ETag first seen by a read that ended at ``t`` was written before
    ``t``, and its holder counts its lease from before that write, on its monotonic clock
    (:meth:`Lease.renew`). So once a read that *begins* ``seconds * (1 + DRIFT)`` after ``t`` still
    finds the same ETag, the holder has not renewed for longer than its lease: it has stopped writing
    (:meth:`Lease.check`), and the lease may be taken (:meth:`Lease.take_over`, conditional on that
    ETag). A standby that was itself frozen only reads again: a lease renewed meanwhile has a new
    ETag, and its wait starts over."""

    def __init__(self, store: ObjectStore, *, monotonic: Callable[[], float] = time.monotonic) -> None:
        self.store = store
        self.monotonic = monotonic
        self._etag: str | None = None
        self._since: float | None = None
        """When the read that first found :attr:`_etag` ended (its writer's latest possible renewal)."""

    def read(self) -> Seen:
        started = self.monotonic()
        got = self.store.get(LEASE)
        ended = self.monotonic()
        if got is None:  # no lease at all: nobody has the run
            self._etag, self._since = None, None
            return Seen(None, "", 0.0, 0.0)
        body, etag = got
        held = _read_lease(body, f"{self.store.url}/{LEASE}")
        seconds = float(held.get("seconds") or 0.0)
        if not held["expires"] or seconds <= 0:  # given back by a clean stop
            return Seen(etag, str(held.get("owner", "?")), seconds, 0.0)
        if etag != self._etag or self._since is None:
            self._etag, self._since = etag, ended
        left = self._since + seconds * (1 + DRIFT) - started
        return Seen(etag, str(held.get("owner", "?")), seconds, max(left, 0.0))
