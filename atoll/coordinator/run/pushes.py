"""Pushes: a header planned against the open round, its bytes held against the in-flight budget while
they stream, each entry validated as it completes, the island's contribution committed whole once
its last rank is in (and decoded into the round's sum); θ_0 assembled from the bootstrap island.

:class:`Pushes` acts on the objects that own the state (membership, the accumulator, the global
model, the ledger); it holds none of its own. The core calls :meth:`Pushes.commit` under its lock.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

import torch

from atoll.compression import WireFormatError, get_codec
from atoll.coordinator.config import RunConfig
from atoll.coordinator.errors import Reason, invalid, refuse
from atoll.coordinator.messages import PushHeader, PushResult
from atoll.coordinator.policy import order, steps, weighting
from atoll.coordinator.policy.weighting import PushClass, classify
from atoll.coordinator.run import checks
from atoll.coordinator.run.owners import Owners
from atoll.coordinator.state import robust
from atoll.coordinator.state.accumulator import assemble, reserved
from atoll.coordinator.state.ledger import BOOTSTRAP
from atoll.coordinator.state.membership import relayed, usual_weight
from atoll.coordinator.state.plans import Committed, HeldPush, PushPlan, StagedRank, release
from atoll.protos.vocabulary import PushKind, PushOutcome

log = logging.getLogger("atoll.coordinator")

Theta0 = tuple[
    dict[str, torch.Tensor], dict[str, tuple[int, ...]], frozenset[str], str | None, dict[str, tuple[str, ...]]
]
"""θ_0 as the bootstrap island sent it: (params, specs, buffers, layout digest, tied-weight aliases)."""


class Pushes:
    def __init__(self, owners: Owners, *, clock: Callable[[], float], name: str = "") -> None:
        self._config = owners.config
        self.membership, self.accumulator = owners.membership, owners.accumulator
        self.model, self.ledger = owners.model, owners.ledger
        self.clock = clock
        self.name = name
        self._said_carried: set[str] = set()
        """Islands whose too-stale push was logged at INFO (the later ones go at DEBUG)."""

    def classify(self, push_round: int) -> PushClass:
        c = self._config()
        return classify(
            push_round,
            self.ledger.round,
            sealed=self.ledger.sealed is not None,
            fold=c.late_policy == "fold",
            max_staleness=c.max_staleness,
        )

    def waits_for_publish(self, push_round: int) -> bool:
        """Whether a delta for ``push_round`` arrives while a round is sealed and will be folded into
        the next one once it is published (late policy fold, within max_staleness)."""
        sealed, c = self.ledger.sealed, self._config()
        if sealed is None or sealed.round == BOOTSTRAP or c.late_policy != "fold" or push_round > sealed.round:
            return False
        return sealed.round + 1 - push_round <= c.max_staleness

    # ---- the header ---------------------------------------------------------------------------
    def plan(self, h: PushHeader) -> PushPlan | PushResult:
        """Validate a push header. Returns the plan, or the result when nothing is to be read."""
        c, ledger = self._config(), self.ledger
        checks.run_id(c, h.run_id)
        rec = self.membership.touch(h.island_id, h.session_id)
        cls = PushClass.NEW
        if h.kind is PushKind.INIT:
            if self.model.ready or ledger.sealed is not None:
                return PushResult(PushOutcome.DUPLICATE, ledger.round, committed=True)
            if not self.membership.claim_bootstrap(h.island_id):
                raise refuse(
                    Reason.NOT_BOOTSTRAPPER,
                    f"island {h.island_id!r} is not the bootstrap island ({self.membership.bootstrapper!r})",
                )
            if h.codec != "identity":
                raise invalid("INIT pushes must use the identity codec")
            specs = checks.tensors(rec.tensors)
        elif h.kind is PushKind.DELTA:
            if not self.model.ready:
                raise refuse(Reason.NO_PARAMETERS, "the run has no parameters yet (bootstrap pending)")
            if ledger.complete(c.total_rounds):
                return PushResult(PushOutcome.RUN_COMPLETE, ledger.round, committed=False)
            checks.codec(c, h.codec)
            held = checks.delta_round(h.round, rec.joined_round)
            cls = self.classify(h.round)
            if cls is PushClass.FUTURE:
                raise refuse(
                    Reason.ROUND_IN_FUTURE,
                    f"round {h.round} is in the future; the coordinator is at round {ledger.round}",
                )
            if cls in (PushClass.CLOSED, PushClass.LATE) and ledger.committed_before(h.island_id, h.round):
                return PushResult(PushOutcome.DUPLICATE, ledger.round, committed=True)  # it counted already
            if not held:
                return self._never_held(h.island_id, h.round, rec.joined_round)
            if cls is PushClass.CLOSED:
                return self._too_stale(h.island_id, h.round)
            if self.accumulator.is_duplicate(h.island_id, h.round, h.rank, cls):
                done = self.accumulator.is_done(h.island_id, h.round, cls)
                return PushResult(PushOutcome.DUPLICATE, ledger.round, committed=done)
            if cls is PushClass.NEW and not h.members and h.island_id in self.accumulator.relayed:
                return self._counted_via_relay(h.island_id, h.round)
            if h.members:  # a relay's push: each island behind it is checked as its own push would be
                checks.members(c, rec.relay, h.members, h.island_id)
                self._not_counted_yet(h)
            else:
                checks.tokens(c, h.tokens, h.inner_steps)
            specs = self.model.specs
        else:
            raise invalid("unknown push kind")
        entries = checks.push_header(h, rec.num_ranks, specs)
        init = h.kind is PushKind.INIT
        return PushPlan(
            h.island_id,
            BOOTSTRAP if init else h.round,
            init,
            h.rank,
            h.num_ranks,
            h.tokens,
            h.loss,
            h.codec,
            entries,
            late=cls is PushClass.LATE,
            inner_steps=h.inner_steps,
            compute_seconds=h.compute_seconds,
            blocked_seconds=h.blocked_seconds,
            members=h.members,
        )

    def check_entry(self, plan: PushPlan, index: int, payload) -> float:
        """Validate one entry's payload (structure, finite values, a norm within the run's limit)
        without decoding it densely; returns the bound of its norm (every value it decodes to is at
        most that in magnitude).

        Runs in a worker thread; the payload stays encoded until the island's contribution commits."""
        entry = plan.entries[index]
        codec = get_codec("identity") if plan.init else self.model.uplink
        try:
            bound = codec.validate(payload, entry.region.sizes)
        except WireFormatError as err:
            raise refuse(Reason.BAD_PAYLOAD, f"tensor {entry.name!r}: {err}") from None
        checks.magnitude(entry.name, bound, plan.init)
        return bound

    # ---- committing ------------------------------------------------------------------------------
    async def commit_delta(self, staged: StagedRank) -> PushResult:
        """Stage one rank of a pseudo-gradient; the island's contribution commits when all its ranks are
        in. The caller holds the core's lock and releases the reservation on an exception."""
        plan, ledger, acc, c = staged.plan, self.ledger, self.accumulator, self._config()
        cls = self.classify(plan.round)  # the round may have moved while the push streamed
        if cls in (PushClass.CLOSED, PushClass.LATE) and ledger.committed_before(plan.island_id, plan.round):
            release([staged])  # it counted in its round while it streamed (a re-push)
            return PushResult(PushOutcome.DUPLICATE, ledger.round, committed=True)
        if cls in (PushClass.CLOSED, PushClass.FUTURE):
            release([staged])
            return self._too_stale(plan.island_id, plan.round)
        rec = self.membership.islands.get(plan.island_id)
        if rec is None or rec.num_ranks != plan.num_ranks:
            raise refuse(Reason.NOT_JOINED, f"island {plan.island_id!r} left or re-joined while pushing")
        if acc.is_duplicate(plan.island_id, plan.round, plan.rank, cls):
            release([staged])
            done = acc.is_done(plan.island_id, plan.round, cls)
            return PushResult(PushOutcome.DUPLICATE, ledger.round, committed=done)
        ranks = acc.stage(staged, rec.num_ranks)
        if ranks is None:
            return PushResult(PushOutcome.STAGED, ledger.round, committed=False, bytes_received=plan.num_bytes)
        late = cls is PushClass.LATE
        rule = self._rule()  # (None: sync mode, no step scale)
        held = False
        try:
            checks.coverage(self.model.specs, ranks, f"island {plan.island_id!r} discarded for round {ledger.round}")
            weight = self._weight(plan, ledger.round - plan.round if late else 0)
            # A relay's mean carries each of its islands' step scales already (its own sum applied them).
            scale = 1.0 if plan.members else weighting.step_scale(rule, c.sync_every, ranks[0].plan.inner_steps)
            acc.admit(weight * scale * max(r.magnitude for r in ranks), f"island {plan.island_id!r}")
            began = time.perf_counter()
            if c.aggregation == "mean" and not c.max_delta_norm:
                held = not late and self._holds(plan.island_id, reserved(ranks), c)
                if held:  # the accumulator's now: added (and released) in its turn
                    acc.hold(plan.island_id, HeldPush(ranks, weight * scale))
                else:  # (a late delta enters out of the order)
                    await self._into_sum(ranks, weight * scale, None if late else plan.island_id)
            else:
                await self._add_dense((plan.island_id, plan.round), ranks, weight, c, scale)
            decoded = time.perf_counter() - began
        finally:
            if not held:
                release(ranks)  # decoded into the sum (or refused): the payloads are done
        num_bytes = sum(r.plan.num_bytes for r in ranks)
        now = self.clock()
        first = ranks[0].plan  # the island's numbers travel with every rank's header: rank 0's count
        record = Committed(
            first.tokens,
            first.loss,
            num_bytes,
            weight,
            first.inner_steps,
            first.compute_seconds,
            at=now,
            decode_seconds=decoded,
            members=first.members,
            entered=self._entered(plan, ledger.round - plan.round if late else 0) if plan.members else None,
        )
        acc.commit(plan.island_id, plan.round, record, late)
        usual = self._weight(plan, 0) if late else weight
        rec.entered(
            ledger.round,
            now=now,
            usual_weight=self._usual(plan, usual),
            compute_seconds=first.compute_seconds,
            blocked_seconds=first.blocked_seconds,
            tokens=first.tokens,
            on_time=None if late else (plan.round, ledger.opened_at),
        )
        if first.members:
            relayed(rec, [(m.named(plan.island_id), m.joined_seconds, m.compute_seconds, m.tokens)
                          for m in first.members], now)  # fmt: skip
        if late:
            log.info(
                "%sround %d: folded island %s's late delta for round %d (weight %.3g)",
                self.name,
                ledger.round,
                plan.island_id,
                plan.round,
                weight,
            )
        else:
            log.info(
                "%sround %d: island %s committed (%d tokens)", self.name, ledger.round, plan.island_id, plan.tokens
            )
        if not late:
            await self.add_held()  # one that sorts after it may have waited for it
        ledger.poke.set()
        outcome = PushOutcome.FOLDED if late else PushOutcome.COMMITTED
        return PushResult(outcome, ledger.round, committed=True, bytes_received=plan.num_bytes)

    # ---- the fixed order of the round's sum ------------------------------------------------------
    def _waiting(self) -> set[str]:
        """The islands whose push for the open round may still come: members not committed in it."""
        return set(self.membership.islands) - set(self.accumulator.committed)

    def _holds(self, island_id: str, num_bytes: int, c: RunConfig) -> bool:
        """Whether a sync round's contribution waits for its turn in the sum's fixed order rather than
        entering now (:mod:`~atoll.coordinator.policy.order`). Held bytes stay within half the in-flight
        budget, so the pushes it waits for are admitted: past that it enters now, out of the order (the
        round's record then says ``sum_order: arrival``)."""
        acc = self.accumulator
        if c.outer_mode != "sync" or order.may_add(island_id, len(acc.sequence), self._waiting() | set(acc.held)):
            return False
        return acc.held_bytes() + num_bytes <= acc.budget.limit // 2

    async def add_held(self, everything: bool = False) -> None:
        """Add the held contributions whose turn has come (``everything``: all of them, in their order:
        the round closes). The caller holds the core's lock."""
        acc = self.accumulator
        while acc.held and (turn := sorted(acc.held) if everything else acc.ready(self._waiting())):
            for island_id in turn:
                held = acc.held.pop(island_id)
                try:
                    began = time.perf_counter()
                    await self._into_sum(held.ranks, held.weight, island_id)
                    if (record := acc.committed.get(island_id)) is not None:
                        record.decode_seconds += time.perf_counter() - began
                finally:
                    release(held.ranks)

    async def _into_sum(self, ranks: list[StagedRank], weight: float, island_id: str | None) -> None:
        """Decode ``ranks`` into the round's sum (worker thread); their buffers then serve the next pushes."""
        await asyncio.to_thread(self.accumulator.add, ranks, self.model.uplink, weight, island_id)
        self.accumulator.recycle(ranks)  # only once the add is done (a cancelled await leaves it running)

    def _counted_via_relay(self, island_id: str, round_: int) -> PushResult:
        """An island whose work for the open round came in a relay's push pushes it itself (its relay
        died after forwarding, and the island moved here): it counts once, as the relay's, and the
        island is committed in the round (weight 0: the round's barrier waits for it no more)."""
        relay = self.accumulator.relayed[island_id]
        log.info(
            "%sround %d: island %s's push counted already, in relay %s's: not added again", self.name, round_,
            island_id, relay,
        )  # fmt: skip
        self.accumulator.commit(island_id, round_, Committed(0, None, 0, 0.0, at=self.clock()), late=False)
        self.ledger.poke.set()
        return PushResult(PushOutcome.DUPLICATE, self.ledger.round, committed=True)

    def _not_counted_yet(self, h: PushHeader) -> None:
        """A relay's push must not count an island twice: one that committed here itself this round
        (it moved from this relay, or to it) is refused, before anything is read."""
        twice = sorted(m.island_id for m in h.members if m.island_id in self.accumulator.committed)
        twice += sorted(
            m.island_id for m in h.members if self.accumulator.relayed.get(m.island_id, h.island_id) != h.island_id
        )
        if twice:
            raise invalid(
                f"relay {h.island_id!r}'s push for round {h.round} counts islands that counted this round already: "
                f"{twice[:5]}"
            )

    def _too_stale(self, island_id: str, round_: int) -> PushResult:
        """A delta for a round that closed, too late to fold: not added, and said in the open round's
        record (``too_stale``) and the ``pushes_carried`` counter. Its work is not lost (the island
        re-bases on the newest θ with its progress kept and carries it into its next push), so this is
        one INFO line per island, not a warning per push."""
        if (island_id, round_) not in self.accumulator.too_stale:
            self.accumulator.too_stale.add((island_id, round_))
            level = logging.DEBUG if island_id in self._said_carried else logging.INFO
            self._said_carried.add(island_id)
            log.log(
                level,
                "%sisland %s's delta for round %d came at round %d, too stale to fold (max_staleness %d, late "
                "policy %s): not added; the island carries its work into its next push (counted as "
                "pushes_carried; said once per island)",
                self.name,
                island_id,
                round_,
                self.ledger.round,
                self._config().max_staleness,
                self._config().late_policy,
            )
        return PushResult(PushOutcome.ROUND_CLOSED, self.ledger.round, committed=False, carried=True)

    def _never_held(self, island_id: str, round_: int, joined_round: int) -> PushResult:
        """A delta for a round before the island joined: it never held that θ, so it counts nowhere
        (a delta folded once per such round would let one island count many times)."""
        log.warning(
            "%sisland %s pushed a delta for round %d, before it joined (round %d): not counted",
            self.name,
            island_id,
            round_,
            joined_round,
        )
        return PushResult(PushOutcome.ROUND_CLOSED, self.ledger.round, committed=False)

    def round_weight(self) -> tuple[float | None, float]:
        """The open round's share of a full round and the denominator of its mean: a decoupled round of
        some islands steps by its share (:func:`~atoll.coordinator.policy.weighting.round_share`); a
        round of everyone (sync mode, the ``full`` rule) has no share and Σ w_i."""
        c, acc = self._config(), self.accumulator
        weight = acc.weight_total()
        rule = self._rule()
        if rule is None or not rule.by_share:
            return None, weight
        full = usual_weight(self.membership.islands.values(), self.membership.clock())
        return weighting.round_share(rule, weight, acc.entered_weight(rule, c.sync_every), full)

    def _member_weights(self, plan: PushPlan, late_by: int) -> list[tuple[float, int]]:
        """A relay's push: each member's (weight, inner steps), weighed as its own push would be."""
        c = self._config()
        per_step = self.ledger.tokens_per_step() or self.accumulator.tokens_per_step()
        return [
            (
                weighting.weight(m.tokens, m.inner_steps, per_step, c.token_bound, c.staleness_weight, late_by),
                m.inner_steps,
            )
            for m in plan.members
        ]

    def _entered(self, plan: PushPlan, late_by: int) -> float:
        """A relay's Σ w_i s_i: its members' weights times their step scales (the share's numerator)."""
        rule, h = self._rule(), self._config().sync_every
        return sum(w * weighting.step_scale(rule, h, n) for w, n in self._member_weights(plan, late_by))

    def _usual(self, plan: PushPlan, usual: float) -> float:
        """What the contribution brings to a round of everyone: a relay's, its members' together."""
        rule, h = self._rule(), self._config().sync_every
        if plan.members:
            return sum(weighting.per_round_weight(rule, w, h, n) for w, n in self._member_weights(plan, 0))
        return weighting.per_round_weight(rule, usual, h, plan.inner_steps)

    def _rule(self) -> steps.DecoupledStep | None:
        """The decoupled run's step rule (None: sync mode)."""
        c = self._config()
        return steps.rule(c.decoupled_step) if c.outer_mode == "decoupled" else None

    def _weight(self, plan: PushPlan, late_by: int) -> float:
        """The island's weight in the round's mean (:func:`~atoll.coordinator.policy.weighting.weight`),
        from the tokens per step of the islands that report them (the last closed round's, else this
        round's so far); a token-less island is warned about, since it was once weighed 1 token. A
        relay's push (its payload the weighted mean of its members' deltas) weighs what its members
        do, each weighed here as its own push would be."""
        c = self._config()
        if plan.members:
            return sum(w for w, _ in self._member_weights(plan, late_by))
        per_step = self.ledger.tokens_per_step() or self.accumulator.tokens_per_step()
        w = weighting.weight(plan.tokens, plan.inner_steps, per_step, c.token_bound, c.staleness_weight, late_by)
        if not plan.tokens and plan.inner_steps:
            log.warning(
                "%sisland %s reported no tokens for its %d inner steps: weighed as %d steps x %.4g tokens per step "
                "(pass tokens= to step())",
                self.name,
                plan.island_id,
                plan.inner_steps,
                plan.inner_steps,
                per_step or 1.0,
            )
        return w

    async def _add_dense(
        self, key: tuple[str, int], ranks: list[StagedRank], weight: float, c: RunConfig, scale: float
    ) -> None:
        """Norm bound and robust aggregation need the island's whole delta: assemble it densely."""
        delta = await asyncio.to_thread(assemble, ranks, self.model.specs, self.model.uplink)
        norm = robust.l2_norm(delta)
        if c.max_delta_norm and norm > c.max_delta_norm:
            raise refuse(
                Reason.DELTA_TOO_LARGE,
                f"island {key[0]!r} discarded for round {key[1]}: delta norm {norm:.4g} exceeds {c.max_delta_norm:g}",
            )
        if scale != 1.0:
            for t in delta.values():
                t.mul_(scale)
        self.accumulator.add_dense(key, delta, weight, mean=c.aggregation == "mean")

    def commit_init(self, staged: StagedRank) -> PushResult | Theta0:
        """Stage one rank of θ_0; once the bootstrap island's ranks are all in, θ_0 (for the core to seal
        and publish). The caller holds the core's lock and releases the reservation on an exception."""
        plan = staged.plan
        if self.model.ready or self.ledger.sealed is not None:
            release([staged])
            return PushResult(PushOutcome.DUPLICATE, self.ledger.round, committed=True)
        rec = self.membership.islands.get(plan.island_id)
        if rec is None or not self.membership.claim_bootstrap(plan.island_id):
            raise refuse(Reason.NOT_BOOTSTRAPPER, f"island {plan.island_id!r} no longer holds the bootstrap claim")
        ranks = self.accumulator.stage(staged, plan.num_ranks)
        if ranks is None:
            return PushResult(PushOutcome.STAGED, 0, committed=False, bytes_received=plan.num_bytes)
        try:
            specs = checks.tensors(rec.tensors)
            checks.coverage(specs, ranks, "bootstrap θ rejected")
            params = {k: torch.zeros(s, dtype=torch.float32) for k, s in specs.items()}
            ident = get_codec("identity")
            for r in ranks:
                for entry, payload in zip(r.plan.entries, r.payloads, strict=True):
                    params[entry.name][entry.region.slices()] = ident.decode(payload, entry.region.sizes)
        finally:
            release(ranks)
        return params, specs, checks.buffers_of(rec.tensors), rec.layout_digest or None, checks.aliases_of(rec.tensors)
