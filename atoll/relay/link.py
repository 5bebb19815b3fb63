"""A relay's link to the coordinator above it (:class:`RelayUpstream`): the
:class:`~atoll.coordinator.run.upstream.Upstream` a relay's run core calls.

It joins the upstream as a relay (with the model its first island declared) and adopts the run's
configuration from the answer; each round it sends its islands' weighted mean up as one push that
names them, pulls the update, and makes θ_{r+1} exactly as an island applies an update, so the relay
serves its islands the upstream's own update bytes. A relay that is still joining refuses relays
below it with RELAY_NOT_READY and the chain it waits on; a chain that comes back to this relay is a
loop (RELAY_LOOP), said once to whoever joins.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
import uuid
from collections.abc import Callable

import grpc
import torch

from atoll.compression import ErrorFeedback, codec_of, get_codec
from atoll.coordinator.config import RunConfig
from atoll.coordinator.errors import Reason, RequestError, refuse
from atoll.coordinator.messages import JoinRequest
from atoll.coordinator.run import checks
from atoll.coordinator.state.accumulator import mean_of
from atoll.coordinator.state.ledger import Sealed
from atoll.coordinator.state.plans import Committed
from atoll.islands import ClientTls, CoordinatorClient, RetryPolicy, WireTransport
from atoll.islands.session import Identity, JoinAnswer, Session, Update
from atoll.protos.messages import Entry, Member, PushHeader, TensorRegion
from atoll.protos.reasons import FATAL
from atoll.protos.status import chain_of, reason_of
from atoll.protos.vocabulary import PushKind, PushOutcome, UpdateKind

log = logging.getLogger("atoll.relay")

JOIN_GIVE_UP_SECONDS = 5.0
"""How long one join of the upstream retries an unreachable or not-ready upstream before the relay
tells whoever joins it to retry (RELAY_NOT_READY): a chain of relays reports a loop within seconds."""


def usable(config: RunConfig) -> None:
    """Refuse a run a relay cannot serve (RequestError, final): the root must take a weighted mean of
    sums. Robust aggregation (and a bound on each island's delta norm) needs each island's whole delta."""
    if config.aggregation != "mean" or config.max_delta_norm:
        why = f"aggregation {config.aggregation!r} (or a delta norm bound) needs each island's whole delta at the root"
        raise RequestError(Reason.BAD_REQUEST, f"a relay cannot serve this run: {why}", code="FAILED_PRECONDITION")


def via(island: str, x: Committed, joined_seconds: float) -> list[Member]:
    """What a contribution to this relay reports up: the island itself (joined here ``joined_seconds``),
    or a relay's members, each with the way it came (``via``: that relay, then the relays below it)."""
    if not x.members:
        return [Member(island, x.tokens, x.inner_steps, x.loss, x.compute_seconds, "", joined_seconds)]
    return [dataclasses.replace(m, via="/".join(filter(None, (island, m.via)))) for m in x.members]


def merged(reports: list[Member]) -> list[Member]:
    """One report per island: an island with an on-time and a folded late contribution in the same
    round reports their tokens, steps and compute together (the loss of the first)."""
    out: dict[tuple[str, str], Member] = {}
    for m in reports:
        key = (m.island_id, m.via)
        if key in out:
            was = out[key]
            m = dataclasses.replace(
                was,
                tokens=was.tokens + m.tokens,
                inner_steps=was.inner_steps + m.inner_steps,
                compute_seconds=was.compute_seconds + m.compute_seconds,
            )
        out[key] = m
    return list(out.values())


def encode_mean(sums: dict[str, torch.Tensor], weight: float, codec, ef: dict[str, dict]) -> list[bytearray]:
    """The payloads of the weighted mean ``sums / weight`` in ``codec``, tensor by tensor; ``sums`` is
    divided in place, and its tensors are the caller's storage for θ_{r+1} afterwards (their values
    spent). A lossy codec encodes the mean plus the residual its last encoding left, with error
    feedback (:class:`~atoll.compression.ErrorFeedback`, its state by tensor in ``ef``): what it drops is
    carried to the next round, not lost. The mean's own storage becomes the new residual, and the old
    residual's goes back into ``sums``: no tensor the size of θ is allocated after the first round, and a
    chunked codec subtracts each chunk's decoded values as it encodes them."""
    feedback = ErrorFeedback(codec) if codec.lossy else None
    payloads = []
    for name, t in sums.items():
        t.div_(weight if weight > 0 else 1.0)
        if feedback is None:
            payloads.append(codec.encode(t))
            continue
        state = ef.setdefault(name, {})
        spare = state.get("residual")
        payloads.append(feedback.encode_consuming(t, state))
        sums[name] = spare if spare is not None else torch.empty_like(t)
    return payloads


class RelayUpstream:
    def __init__(
        self,
        address: str,
        *,
        run_id: str,
        relay_id: str,
        token: str | None = None,
        tls: ClientTls | None = None,
        retry: RetryPolicy | None = None,
        pull_wait_seconds: float = 10.0,
        heartbeat_seconds: float = 5.0,
        quorum: int = 1,
        grace_window: str | None = None,
    ) -> None:
        """``quorum``: how many of its islands a relay's round waits for (up to the run's round deadline)
        beyond every live one: its own, not the root's (whose quorum counts the run's islands). ``grace_window``:
        how long its round waits for its missing islands once the quorum is in (None: the run's; "0":
        it forwards what has arrived at once, whenever it is free to)."""
        if quorum < 1:
            raise ValueError(f"a relay's quorum is at least 1, got {quorum}")
        self.address, self.run_id, self.relay_id, self.quorum = address, run_id, relay_id, quorum
        self.grace_window = grace_window
        self.chain: tuple[str, ...] = (relay_id,)
        self.retry = retry or RetryPolicy(give_up_seconds=600.0)
        client = CoordinatorClient(address, retry=self.retry, token=token, tls=tls)
        self.transport = WireTransport(client)
        self.me = Identity(run_id, relay_id, uuid.uuid4().hex, 0, 1)
        self.pull_wait_seconds, self.heartbeat_seconds = pull_wait_seconds, heartbeat_seconds
        self.session: Session | None = None
        self.joined: JoinAnswer | None = None
        self.state = None
        """The relay's run core (``RunState``), set by the daemon."""
        self._joining = False
        self._heard: tuple[str, ...] = ()
        """The chain the upstream last said it waits on (a relay still joining its own upstream)."""
        self._theta0_ours = False
        """The upstream gave this relay its bootstrap claim: θ_0 comes from one of our islands."""
        self._ef: dict[str, dict] = {}
        """The uplink codec's error feedback state of the relay's own encode, by tensor (lossy codecs; kept
        in memory)."""
        self._stopping = threading.Event()
        self._heartbeat: threading.Thread | None = None
        self._fetching: asyncio.Future | None = None
        self._pending: list[tuple[Update, list]] = []
        """Updates pulled past the round stepped (the upstream moved on more than one round), in order."""
        self.bytes_up = 0
        """Payload bytes this relay pushed upstream (its islands' sums)."""

    # ---- joining -------------------------------------------------------------------------------
    async def before_join(self, req: JoinRequest) -> None:
        if self.joined is not None:
            return
        if self._joining:
            raise self._not_ready("it is joining its upstream now")
        self._joining = True
        try:
            answer = await asyncio.to_thread(self._join_up, req)
        finally:
            self._joining = False
        await self._adopt(answer, req)

    def _not_ready(self, why: str) -> RequestError:
        return RequestError(
            Reason.RELAY_NOT_READY,
            f"relay {self.relay_id!r} has not joined its upstream {self.address} yet ({why}); retry",
            chain=self.chain + self._heard,
        )

    def _join_up(self, req: JoinRequest) -> JoinAnswer:
        """(worker thread) Join the upstream as a relay with the model ``req`` declares."""
        up = JoinRequest(
            codecs=req.codecs,
            tensors=req.tensors,
            layout_digest=req.layout_digest,
            model_card=req.model_card,
            relay=True,
        )
        try:
            return self.transport.join(self.me, up, give_up_seconds=JOIN_GIVE_UP_SECONDS)
        except grpc.RpcError as err:
            reason, heard = reason_of(err), chain_of(err)
            self._heard = heard
            if self.relay_id in heard:
                loop = " -> ".join((self.relay_id, *heard[: heard.index(self.relay_id) + 1]))
                log.error("relay %s: its upstream chain comes back to it (%s): a loop", self.relay_id, loop)
                raise refuse(Reason.RELAY_LOOP, f"relay loop: {loop}; point one relay's --upstream elsewhere") from None
            if reason is Reason.SESSION_CONFLICT:  # our own previous process (a restart): its lease runs out
                raise self._not_ready("the upstream holds our previous process until its lease runs out") from None
            if reason in FATAL:  # the upstream refused the relay for good (another run id, another model)
                log.error("relay %s: the upstream %s refused it: %s", self.relay_id, self.address, err.details())
                raise RequestError(reason, f"the relay's upstream refused it: {err.details()}") from None
            raise self._not_ready(f"{err.code().name}: {err.details()}") from None

    async def _adopt(self, answer: JoinAnswer, req: JoinRequest) -> None:
        """Serve the upstream's run: its configuration, its chain, and θ (or the claim to upload θ_0)."""
        # The run's math is the upstream's; which of its own islands a relay's round waits for is its own:
        # each live one, and at least its quorum (the root's counts the islands of the whole run).
        config = dataclasses.replace(RunConfig(**answer.config), quorum=self.quorum)
        if self.grace_window is not None:
            config = dataclasses.replace(config, grace_window=self.grace_window)
        usable(config)
        if config.run_id != self.run_id:  # (the upstream checked the run id; its config says the same)
            raise refuse(Reason.WRONG_RUN, f"the upstream serves run {config.run_id!r}, not {self.run_id!r}")
        state = self.state
        state.config = config
        state.model.configure(config)
        self.chain = (self.relay_id, *answer.relay_chain)
        self.session = Session(
            0,
            self.transport,
            self.me,
            lambda: JoinRequest(codecs=req.codecs, tensors=req.tensors, layout_digest=req.layout_digest, relay=True),
            [TensorRegion(t.name) for t in req.tensors],
            pull_wait_seconds=self.pull_wait_seconds,
        )
        self.session.joined = answer
        self.joined = answer
        self._heartbeat = threading.Thread(target=self._heartbeats, name="atoll-relay-heartbeat", daemon=True)
        self._heartbeat.start()
        log.info(
            "relay %s joined %s (run %s, round %d, chain %s)%s",
            self.relay_id,
            self.address,
            config.run_id,
            answer.round,
            " -> ".join(self.chain),
            ": its islands bootstrap θ_0" if answer.bootstrap else "",
        )
        if answer.bootstrap:
            self._theta0_ours = True
            return  # an island of ours takes the claim and uploads θ_0; send_theta0 passes it up
        state.membership.bootstrap_open = lambda: False
        self._fetching = asyncio.ensure_future(self._fetch_theta(req))
        self._fetching.add_done_callback(self._fetched)

    def _fetched(self, task: asyncio.Task) -> None:
        if not task.cancelled() and task.exception() is not None:  # its islands would wait for θ for ever
            log.error("relay %s: θ from the upstream failed: %s", self.relay_id, task.exception())

    async def _fetch_theta(self, req: JoinRequest) -> None:
        """θ from the upstream (the run's θ_0, or θ of its open round), installed as ours."""
        got: list = []
        await asyncio.to_thread(
            self.session.pull_until_ready, -1, on_update=lambda h, p: got.append((h, p)), cancel=self._stopping
        )
        header, payloads = got[-1]
        if header.kind is not UpdateKind.FULL:
            raise RuntimeError(f"relay {self.relay_id}: the upstream answered a θ pull with {header.kind}")
        specs = checks.tensors(req.tensors)
        params = {
            e.name: codec_of(p).decode(p, specs[e.name]) for e, (_, p) in zip(header.entries, payloads, strict=True)
        }
        state = self.state
        async with state.lock:
            state.model.define(
                specs, checks.buffers_of(req.tensors), req.layout_digest or None, checks.aliases_of(req.tensors)
            )
            state.ledger.seal(Sealed(header.round - 1, params, None, None, frozenset()))
            log.info("relay %s: θ of round %d from the upstream", self.relay_id, header.round)
        await state.try_publish()

    def send_theta0(self, params: dict[str, torch.Tensor]) -> None:
        """(worker thread) θ_0 from our bootstrap island, up to the root (the upstream's claim is ours)."""
        if not self._theta0_ours:
            return
        ident = get_codec("identity")
        names = list(params)
        payloads = [ident.encode(params[n]) for n in names]
        header = PushHeader(
            kind=PushKind.INIT,
            round=0,
            codec="identity",
            entries=tuple(Entry(n, (), (), len(p)) for n, p in zip(names, payloads, strict=True)),
        )
        outcome = self.session.push(header, payloads)
        if outcome not in (PushOutcome.COMMITTED, PushOutcome.DUPLICATE):
            raise RuntimeError(f"relay {self.relay_id}: the upstream took θ_0 as {outcome.name}")
        self._theta0_ours = False
        log.info("relay %s: θ_0 of its bootstrap island sent up", self.relay_id)

    def _joined_seconds(self) -> Callable[[str], float]:
        """How long each island has been joined here, by id (0: not known), as of now."""
        now, islands = self.state.clock(), self.state.membership.islands

        def joined(island: str) -> float:
            rec = islands.get(island)
            return rec.goodput.wall(now) if rec is not None and rec.goodput is not None else 0.0

        return joined

    # ---- rounds -------------------------------------------------------------------------------
    def step(
        self,
        round_: int,
        sums: dict[str, torch.Tensor],
        weight: float,
        members: list[tuple[str, Committed]],
        made: Callable[[str, bytearray], None],
    ) -> tuple[dict[str, torch.Tensor], dict[str, bytearray] | None, int]:
        config = self.state.config
        names = list(sums)
        payloads = encode_mean(sums, weight, get_codec(config.codec), self._ef)
        joined = self._joined_seconds()
        reports = merged(
            [m for island, x in sorted(members, key=lambda p: p[0]) for m in via(island, x, joined(island))]
        )
        header = PushHeader(
            kind=PushKind.DELTA,
            round=round_,
            codec=config.codec,
            entries=tuple(Entry(n, (), (), len(p)) for n, p in zip(names, payloads, strict=True)),
            tokens=sum(m.tokens for m in reports),
            loss=mean_of([(max(m.tokens, 1), m.loss) for m in reports if m.loss is not None]),
            inner_steps=sum(m.inner_steps for m in reports),
            compute_seconds=sum(m.compute_seconds for m in reports),
            members=tuple(reports),
        )
        outcome = self.session.push(header, payloads)
        self.bytes_up += sum(len(p) for p in payloads)
        if outcome not in (PushOutcome.COMMITTED, PushOutcome.DUPLICATE, PushOutcome.FOLDED):
            log.warning("relay %s: the upstream took round %d's sum as %s", self.relay_id, round_, outcome.name)
        if not self._pending:  # (else the upstream is ahead already: its next update is this round's)
            self.session.pull_until_ready(
                round_,
                on_update=lambda h, p: self._pending.append((h, p)),
                repush=lambda: (header, payloads),
                cancel=self._stopping,  # a relay stopping gives the round up
            )
        return self._apply(round_, sums, made)

    def follow(self, round_: int, params: dict[str, torch.Tensor]):
        """(worker thread) The next update the upstream moved on by, past ``round_``: (θ_{r+1} in new
        tensors, its payloads), or None when there is none."""
        if not self._pending:
            return None
        return self._apply(round_, {n: torch.empty_like(t) for n, t in params.items()}, lambda name, p: None)

    def _apply(self, round_: int, out: dict[str, torch.Tensor], made):
        """The next pending update applied to θ as an island applies it, into ``out``: (θ, its payloads,
        the round it opens); θ itself when the upstream sent θ (payloads None)."""
        update, got = self._pending.pop(0)
        full = update.kind is UpdateKind.FULL
        if not (full and update.round > round_) and not (
            update.kind is UpdateKind.DELTA and update.round == round_ + 1
        ):
            raise RuntimeError(
                f"relay {self.relay_id}: expected round {round_}'s update from the upstream, got {update.kind.name} "
                f"of round {update.round}"
            )
        theta = self.state.model.params
        payloads: dict[str, bytearray] = {}
        for entry, (_, payload) in zip(update.entries, got, strict=True):
            t = out[entry.name]
            if full:
                codec_of(payload).decode_into(payload, t)
                continue
            t.copy_(theta[entry.name])
            codec_of(payload).add_decoded_(payload, t)  # as an island applies it: the same bits
            payloads[entry.name] = bytearray(payload)
            made(entry.name, payloads[entry.name])
        if full:
            log.info(
                "relay %s: the upstream answered round %d's pull with θ of round %d (catching up cost more): its "
                "islands pull that θ", self.relay_id, round_, update.round,
            )  # fmt: skip
            return out, None, update.round
        return out, payloads, update.round

    # ---- keeping the lease ----------------------------------------------------------------------
    def _heartbeats(self) -> None:
        while not self._stopping.wait(self.heartbeat_seconds):
            try:
                self.session.heartbeat()
            except Exception as err:  # never fatal; the next one retries
                log.info("relay %s: heartbeat upstream failed: %s", self.relay_id, err)

    def close(self) -> None:
        self._stopping.set()
        if self.session is not None:
            self.session.leave()
        self.transport.close()
