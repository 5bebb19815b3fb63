"""One island's session with one coordinator shard: join, bootstrap, heartbeats, push, pull.

It speaks the island's messages (:mod:`atoll.islands._messages`) both ways: to the island, and to its
transport (:mod:`atoll.islands._transport.seam`, which alone knows the protobuf form). Every protocol outcome is handled
here, by its reason or outcome field (never by message text):
a coordinator that forgot the island (NOT_JOINED) is re-joined and the call repeated; a refusal
the user must act on (model, codec, run id, island id) becomes :class:`CoordinatorRefused`; a push
for a closed round comes back as ``PUSH_OUTCOME_ROUND_CLOSED`` (the work is dropped); a pull
that finds the bootstrap claim passed to this island uploads θ_0; a long wait for an outer step
is reported at WARNING with what the round waits for.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import grpc

from atoll.compression import WireFormatError
from atoll.islands._messages import Entry, Identity, JoinAnswer, JoinRequest, Pulled, PushHeader, TensorRegion, Update
from atoll.islands._transport import waiting
from atoll.islands._transport.client import RETRYABLE
from atoll.islands._transport.seam import Transport
from atoll.islands._transport.waiting import Act
from atoll.islands.errors import CoordinatorRefused, CoordinatorUnreachable, PartialUpdate, QuorumGone
from atoll.protos.reasons import FATAL, Reason
from atoll.protos.status import reason_of
from atoll.protos.vocabulary import PushKind, PushOutcome, UpdateKind

log = logging.getLogger("atoll.island")

LEAVE_SECONDS = 10.0
"""Leaving tries this long at most: a process stopping (a scheduler's grace period) must not hang on it."""
WAIT_WARN_SECONDS = 60.0
"""Report a wait for an outer step at WARNING after this long, and again as long as it lasts."""


def refused(err: grpc.RpcError) -> CoordinatorRefused | None:
    """The refusal to raise for a call the coordinator refused for good, else None."""
    reason = reason_of(err)
    if reason in FATAL:
        return CoordinatorRefused(reason, err.details() or reason)
    return None


class Session:
    def __init__(
        self,
        index: int,
        transport: Transport,
        me: Identity,
        join_request: Callable[[], JoinRequest],
        regions: list[TensorRegion],
        *,
        pull_wait_seconds: float = 10.0,
    ) -> None:
        """``join_request()`` builds this shard's JoinRequest (its tensors, partition, codecs);
        ``regions``: what this rank pulls (its shards' regions; whole tensors with no offsets)."""
        self.index = index
        self.regions = list(regions)
        self.transport = transport
        self.me = me
        self.join_request = join_request
        self.pull_wait_seconds = pull_wait_seconds
        self.round = -1
        self.run_complete = False
        self.latest_round = -1
        """The coordinator's open round as last heard (heartbeats, pulls): how far the run is ahead."""
        self.joined: JoinAnswer | None = None
        self.last = False
        """This island's next exchange is its last: a round that can never close raises QuorumGone."""

    @property
    def address(self) -> str:
        return self.transport.address

    def join(self, *, give_up_seconds: float | None = None) -> JoinAnswer:
        try:
            resp = self.transport.join(self.me, self.join_request(), give_up_seconds=give_up_seconds)
        except grpc.RpcError as err:
            fatal = refused(err)
            if fatal is not None:
                raise fatal from None
            if err.code() in RETRYABLE:
                raise self._unreachable(err, give_up_seconds) from None
            raise
        self.joined = resp
        self.run_complete = self.run_complete or resp.run_complete
        return resp

    def heartbeat(self) -> None:
        m = self.me
        try:
            resp = self.transport.heartbeat(m, self.round)
            self.run_complete = self.run_complete or resp.run_complete
            self.latest_round = max(self.latest_round, resp.round)
        except grpc.RpcError as err:
            if reason_of(err) is Reason.NOT_JOINED:
                log.info("coordinator shard %d forgot %s; re-joining", self.index, m.island_id)
                try:
                    self.join(give_up_seconds=self.transport.retry.rpc_timeout_seconds)
                except (grpc.RpcError, CoordinatorRefused) as again:
                    log.warning("re-join of shard %d failed: %s", self.index, again)

    def leave(self) -> None:
        try:
            self.transport.leave(self.me, give_up_seconds=min(self.transport.retry.rpc_timeout_seconds, LEAVE_SECONDS))
        except grpc.RpcError as err:
            log.warning("leave failed on shard %d: %s", self.index, err.details())

    def _rejoin_or_raise(self, err: grpc.RpcError) -> None:
        """A push or pull failed: re-join when the coordinator forgot this island (it restarted; the
        caller retries), raise CoordinatorRefused for a reason the user must fix, else ``err``."""
        if reason_of(err) is Reason.NOT_JOINED:
            self.join()
            return
        fatal = refused(err)
        if fatal is not None:
            raise fatal from None
        if err.code() in RETRYABLE:  # the client's retries gave up: one line, every address tried
            raise self._unreachable(err) from None
        raise err

    def _unreachable(self, err: grpc.RpcError, give_up_seconds: float | None = None) -> CoordinatorUnreachable:
        waited = self.transport.retry.give_up_seconds if give_up_seconds is None else give_up_seconds
        return CoordinatorUnreachable(
            f"coordinator {' | '.join(self.transport.alternatives)} unreachable for {waited:.0f}s "
            f"({err.code().name}: {err.details()}); giving up"
        )

    # ---- pushes ------------------------------------------------------------------------------
    @staticmethod
    def header(
        kind: PushKind,
        round_: int,
        shards,
        sizes: list[int],
        codec: str,
        *,
        tokens=0,
        loss=None,
        steps=0,
        compute_seconds=0.0,
        blocked_seconds=0.0,
    ) -> PushHeader:
        """A push header for ``shards`` whose payloads are ``sizes`` bytes (who pushes is said by the
        transport, from :attr:`me`)."""
        entries = tuple(
            Entry(s.name, tuple(s.offsets), tuple(s.sizes), size) for s, size in zip(shards, sizes, strict=True)
        )
        return PushHeader(
            kind=kind,
            round=round_,
            codec=codec,
            entries=entries,
            tokens=tokens,
            loss=loss,
            inner_steps=steps,
            compute_seconds=compute_seconds,
            blocked_seconds=blocked_seconds,
        )

    def push(self, header: PushHeader, payloads) -> PushOutcome:
        """Push (``payloads``: a list, or ``encode(i)``, see CoordinatorClient.push); returns the
        outcome (ROUND_CLOSED: the round closed first; the island keeps the work)."""
        while True:
            try:
                outcome = self.transport.push(self.me, header, payloads)
            except grpc.RpcError as err:
                self._rejoin_or_raise(err)
                continue
            if outcome is PushOutcome.ROUND_CLOSED:  # (the island re-bases with its progress kept: nothing lost)
                log.info(
                    "%s: round %d closed before our push arrived; its work goes into our next push",
                    self.me.island_id,
                    header.round,
                )
            elif outcome is PushOutcome.RUN_COMPLETE:
                self.run_complete = True
            return outcome

    # ---- pulls -------------------------------------------------------------------------------
    def pull_until_ready(
        self,
        have_round: int,
        *,
        on_update: Callable[[Update, list], None] | None = None,
        on_entry: Callable[[Update, int, object], None] | None = None,
        repush: Callable[[], tuple] | None = None,
        bootstrap: Callable[[], bool] | None = None,
        cancel: threading.Event | None = None,
    ) -> tuple[Pulled, float | None]:
        """Long-poll until the outer step past ``have_round`` is out; hand each update (several when
        catching up, one round each) to ``on_update(header, payloads)``. Returns (how it ended, loss):
        NOT_READY when the run completed with this island already holding its final θ.

        ``on_entry(header, i, payload)`` instead of ``on_update``: apply each entry as it arrives (one
        entry held at a time); an update that breaks off half-applied is followed by the full θ, and
        when that is still θ of ``have_round`` (the coordinator lost the round: a tentative update that
        was never saved) the long-poll goes on, re-pushing as below: θ_start is the round's start again
        and the parameters were not touched, so the push is the same bytes. ``repush()``: (header,
        payloads) of this island's push for ``have_round``, sent again when the coordinator says it has
        none (it restarted). ``bootstrap()``: upload θ_0 when the claim passes
        to this island; True when the run's θ_0 is that upload and this rank holds all of it (returns
        BOOTSTRAPPED: nothing to pull back). ``cancel``: give up between polls once set (the island
        is closing)."""
        started = warned = time.monotonic()
        w = waiting.start(have_round, can_repush=repush is not None)
        m, act = self.me, Act.PULL
        while True:
            if cancel is not None and cancel.is_set():
                raise RuntimeError(f"{m.island_id}: closed while waiting for round {w.have_round}'s outer step")
            wait_seconds = 0.0 if act is Act.ASK else self.pull_wait_seconds
            try:
                header, payloads = self.transport.pull(
                    m, w.have_round, wait_seconds=wait_seconds, regions=self.regions, on_entry=on_entry
                )
            except (PartialUpdate, WireFormatError) as err:
                w, act = waiting.broken(w)
                if act is Act.FAIL:
                    raise
                log.warning("%s: an update broke off half-applied (%s); pulling the full θ", m.island_id, err)
                continue
            except grpc.RpcError as err:
                self._rejoin_or_raise(err)
                continue
            self.run_complete = self.run_complete or header.run_complete
            if header.kind is not UpdateKind.NOT_READY:
                if on_update is not None:
                    on_update(header, payloads)
                self.round = header.round
                self.latest_round = max(self.latest_round, header.latest_round)
            w, act = waiting.answered(w, header, can_upload=bootstrap is not None, last=self.last)
            if act is Act.DONE:
                return Pulled[header.kind.name], header.loss
            if act is Act.COMPLETE:
                return Pulled.NOT_READY, None
            if act is Act.GIVE_UP:
                raise QuorumGone(
                    f"{m.island_id}: round {header.round} can never close as things stand "
                    f"({header.waiting or 'the quorum is gone'})"
                )
            if act is Act.UPLOAD:
                log.warning("%s: the bootstrap claim passed to this island; uploading θ_0", m.island_id)
                if bootstrap():
                    return Pulled.BOOTSTRAPPED, None
                continue
            if act is Act.REPUSH:  # the coordinator lost our push (it restarted): idempotent, so again
                log.info("%s: coordinator has no push from us for round %d; re-pushing", m.island_id, w.have_round)
                w = waiting.repushed(w, self.push(*repush()) is PushOutcome.ROUND_CLOSED)
            now = time.monotonic()
            if header.kind is UpdateKind.NOT_READY and now - warned >= WAIT_WARN_SECONDS:
                log.warning(
                    "%s: waited %.0fs for round %d's outer step (shard %d): %s",
                    m.island_id,
                    now - started,
                    header.round,
                    self.index,
                    header.waiting or "the coordinator has not closed the round",
                )
                warned = now
