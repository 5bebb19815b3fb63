"""Pulls: a long-poll for the next θ, answered with the encoded outer update (one round at a time for an
island a few rounds behind), the full θ, or NOT_READY saying what the open round waits for.

:class:`Pulls` acts on the objects that own the state (membership, the accumulator, the global model,
the ledger, the downlink) and holds none of its own.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable

from atoll.coordinator.messages import PullAnswer, PullRequest
from atoll.coordinator.run import checks
from atoll.coordinator.run.owners import Owners
from atoll.coordinator.state.downlink import Downlink
from atoll.coordinator.state.ledger import Confirmation, Stage
from atoll.protos.rpc import DURABLE_WAIT_SECONDS
from atoll.protos.vocabulary import UpdateKind

MAX_WAIT_SECONDS = 60.0


async def wait_event(event: asyncio.Event, timeout: float) -> bool:
    """Wait up to ``timeout`` seconds for ``event``; returns whether it is set.

    Not ``asyncio.wait_for``: before Python 3.12 it swallows a cancellation of the caller that
    lands in the same loop iteration as the event (python/cpython#86296): the decider then never
    stops, and the server's stop waits on it forever.
    """
    waiter = asyncio.ensure_future(event.wait())
    try:
        await asyncio.wait({waiter}, timeout=timeout)
    finally:
        waiter.cancel()
    return event.is_set()


class Pulls:
    def __init__(
        self, owners: Owners, *, downlink: Downlink, waiting: Callable[[], str], stalled: Callable[[], bool]
    ) -> None:
        """``waiting()``: what the open round waits for, for people (the decider's last reason);
        ``stalled()``: whether it can never close as things stand (the decider's stall)."""
        self._config = owners.config
        self.membership, self.accumulator = owners.membership, owners.accumulator
        self.model, self.ledger = owners.model, owners.ledger
        self.downlink = downlink
        self.waiting, self.stalled = waiting, stalled
        self.polling = 0
        """Pulls in their long-poll now, waiting for the round they hold to move on."""

    async def pull(self, req: PullRequest) -> PullAnswer:
        """The answer to a pull; an update comes with where the island's push landed in its round."""
        answer = await self._pull(req)
        if answer.kind in (UpdateKind.DELTA, UpdateKind.FULL):
            answer.arrival_offset = self.membership.offset_for(req.island_id, answer.round - 1)
        return answer

    async def _pull(self, req: PullRequest) -> PullAnswer:
        c, ledger, model = self._config(), self.ledger, self.model
        checks.run_id(c, req.run_id)
        rec = self.membership.touch(req.island_id, req.session_id)
        wait = min(max(req.wait_seconds, 0.0), MAX_WAIT_SECONDS) if math.isfinite(req.wait_seconds) else 0.0
        if not model.ready:
            if rec.tensors and ledger.sealed is None and self.membership.claim_bootstrap(req.island_id):
                return PullAnswer(UpdateKind.NOT_READY, ledger.round, ledger.round, bootstrap=True)
            await wait_event(ledger.round_changed, wait)
            self.membership.touch(req.island_id, req.session_id)
            if not model.ready:
                holder = self.membership.bootstrapper or "the first island to join"
                why = "θ_0 is being saved" if ledger.sealed is not None else f"waiting for θ_0 from {holder}"
                return PullAnswer(UpdateKind.NOT_READY, 0, 0, waiting=why)
        if rec.tensors:
            checks.same_model(model.specs, checks.tensors(rec.tensors), model.buffers, checks.buffers_of(rec.tensors))
        regions = checks.regions(req.regions, model.specs)
        if req.have_round == ledger.round and not ledger.complete(c.total_rounds):
            deadline = time.monotonic() + wait
            # Until the round it holds moves on, or its update can be streamed (a wake-up for a step
            # streaming whole tensors is not one for a pull of regions), or the wait is over.
            self.polling += 1
            try:
                while (answer := self._streaming(req, regions)) is None and req.have_round == ledger.round:
                    if (left := deadline - time.monotonic()) <= 0:
                        break
                    await wait_event(ledger.round_changed, left)
            finally:
                self.polling -= 1
            if answer is not None:
                return answer  # the step or the save of the round it waits for is under way
            self.membership.touch(req.island_id, req.session_id)
        while (sealed := ledger.sealed) is not None and model.params is sealed.params:
            # Mid-publish: θ_{r+1} is installed, round r+1 not yet open (the replaced θ is being zeroed
            # for the next round's sum). Its advance wakes us; never θ_{r+1} labelled round r.
            await wait_event(ledger.round_changed, 1.0)
        round_, params = ledger.round, model.params
        latest = dict(latest_round=round_, run_complete=ledger.complete(c.total_rounds))
        if req.have_round == round_:
            sealed = ledger.sealed
            committed = req.island_id in self.accumulator.committed or (
                sealed is not None and req.island_id in sealed.islands
            )
            waiting = dict(waiting=self.waiting(), stalled=self.stalled())
            return PullAnswer(UpdateKind.NOT_READY, round_, committed=committed, **waiting, **latest)
        if self.downlink.can_catch_up(req.have_round, round_) and self.downlink.catch_up_pays(
            req.have_round, round_, regions, model.specs, c.downlink_codec
        ):
            nxt = req.have_round + 1  # one round at a time; a lagging island pulls again until latest
            reservation = self.downlink.reserve_delta(nxt, regions, model.specs)  # before it is read
            try:
                entries = self.downlink.delta_entries(nxt, regions, model.specs)
            except BaseException:
                reservation.release()
                raise
            kept = self.downlink.in_memory(nxt)  # the latest update: leased while it streams
            leases = self._leases(req.island_id, [kept[name] for name, _ in regions] if kept else [])
            self.membership.holds(req.island_id, nxt)
            self.release_if_held()
            return PullAnswer(
                UpdateKind.DELTA,
                nxt,
                codec=c.downlink_codec,
                entries=entries,
                loss=ledger.loss_of(nxt - 1),
                reservation=reservation,
                leases=leases,
                **latest,
            )
        entries = Downlink.full_entries(params, regions)
        reservation = self.downlink.reserve(entries)
        self.membership.holds(req.island_id, round_)
        return PullAnswer(
            UpdateKind.FULL,
            round_,
            entries=entries,
            loss=ledger.loss_of(round_ - 1),
            reservation=reservation,
            leases=self._leases(req.island_id, [params[name] for name, _ in regions]),  # θ, sent in place
            **latest,
        )

    def _leases(self, island_id: str, buffers: list) -> list:
        """Leases of a pull of ``island_id`` on what its answer reads in place (θ's tensors, an update's
        payloads): neither is reused while the answer streams (see :class:`~atoll.memory.Leases`)."""
        return [self.model.leases.take(b, f"a pull of island {island_id}") for b in buffers]

    def _streaming(self, req: PullRequest, regions) -> PullAnswer | None:
        """A tentative answer for an island holding θ of the open round, if that round's update is
        being made (whole tensors only) or saved for the first time (:meth:`Ledger.streams`)."""
        ledger, r = self.ledger, self.ledger.round
        if not ledger.streams(r):
            return None
        if ledger.stage is Stage.SAVING:
            sealed = ledger.sealed
            entries = Downlink.entries_of(sealed.payloads, regions, self.model.specs)
            leases = self._leases(req.island_id, [sealed.payloads[name] for name, _ in regions])
            return self._tentative(req.island_id, r, entries, sealed.record.loss, leases)
        if all(region is None for _, region in regions):
            producing, leases = ledger.producing, []
            entries = producing.entries(regions)
            for entry in entries:  # each payload leased as it is made

                async def made(get=entry.made) -> bytearray:
                    payload = await get()
                    leases.extend(self._leases(req.island_id, [payload]))
                    return payload

                entry.made = made
            return self._tentative(req.island_id, r, entries, producing.loss, leases)
        return None

    def _tentative(self, island_id: str, r: int, entries: list, loss: float | None, leases: list) -> PullAnswer:
        """Round ``r``'s update, streamed while the outer step makes it or its first save is under way;
        the stream ends with the confirmation that it is saved and published
        (:attr:`PullAnswer.durable`), and an island's pull returns only after it (one that ends without it
        is a broken update: the island pulls the full θ). So the step's and the save's time overlap
        the transfer, and still an island ends every pull at a θ the coordinator can rebuild.
        Once a save has failed, pulls wait (NOT_READY) as before."""
        c, ledger = self._config(), self.ledger

        async def durable() -> bool:
            deadline = time.monotonic() + DURABLE_WAIT_SECONDS
            while (said := ledger.confirmation(r)) is Confirmation.WAIT:
                if (left := deadline - time.monotonic()) <= 0:
                    return False  # slow to save: the island pulls again
                await wait_event(ledger.round_changed, left)
            if said is Confirmation.BROKEN:
                return False  # its save failed (retried; islands wait for it as NOT_READY)
            self.membership.holds(island_id, r + 1)
            self.release_if_held()
            return True

        return PullAnswer(
            UpdateKind.DELTA,
            r + 1,
            codec=c.downlink_codec,
            entries=entries,
            loss=loss,
            latest_round=r + 1,
            run_complete=bool(c.total_rounds) and r + 1 >= c.total_rounds,
            durable=durable,
            reservation=self.downlink.reserve(entries),
            leases=leases,
        )

    def release_if_held(self) -> None:
        """Once every live island holds the latest θ, its update is served from the log (to
        islands coming back) and the memory is free for the next round's pushes."""
        if all(r.holds_round >= self.ledger.round for r in self.membership.live()):
            self.downlink.release_latest()
