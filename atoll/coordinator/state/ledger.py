"""Where the run stands: the open round, when it opened, the closed rounds' records, the stage of the
open round's update (made, sealed and saved, retried), and the events that wake long-polls and the
decider.

One owner (:class:`Ledger`); the run advances it on the one seal -> persist -> publish path, the
pushes and pulls read it.

A round's update goes through named stages (:class:`Stage`, moved only by :func:`transition`):

- OPEN: the round takes pushes; no update of it exists yet;
- MAKING: its outer step makes the update, tensor by tensor (a pull waiting for it streams each
  payload as it is made: *tentatively*);
- SAVING: computed and sealed (it takes no more pushes); its first save is under way (pulls stream it
  tentatively);
- RETRYING: a save failed and is retried with backoff: tentative streams end unconfirmed (NOT_DURABLE,
  the island pulls again) and new pulls wait (NOT_READY);
- the save succeeds: the round is published and the next one is OPEN. A tentative stream of it gets
  its confirmation (``Durable``) only then.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial

import torch

from atoll.coordinator.errors import Reason, refuse
from atoll.coordinator.messages import PayloadEntry
from atoll.coordinator.policy.goodput import tokens_per_step
from atoll.coordinator.state.record import RoundRecord

SAVE_RETRY_SECONDS = (0.5, 30.0)
"""First wait after a failed save, and the cap of its doubling."""
BOOTSTRAP = -1
"""The "round" that θ_0 closes: publishing it opens round 0."""


class Stage(enum.Enum):
    OPEN = "open"
    MAKING = "making"
    SAVING = "saving"
    RETRYING = "retrying"


class Event(enum.Enum):
    STEP = "step"
    """The outer step starts making the round's update."""
    STEP_ENDED = "step_ended"
    """The step ended without sealing (it failed: the round is open as before)."""
    SEALED = "sealed"
    SAVE_FAILED = "save_failed"
    PUBLISHED = "published"


TRANSITIONS: dict[tuple[Stage, Event], Stage] = {
    (Stage.OPEN, Event.STEP): Stage.MAKING,
    (Stage.MAKING, Event.STEP_ENDED): Stage.OPEN,
    (Stage.MAKING, Event.SEALED): Stage.SAVING,
    (Stage.OPEN, Event.SEALED): Stage.SAVING,  # θ_0: no step makes it
    (Stage.SAVING, Event.SAVE_FAILED): Stage.RETRYING,
    (Stage.RETRYING, Event.SAVE_FAILED): Stage.RETRYING,
    (Stage.SAVING, Event.PUBLISHED): Stage.OPEN,  # the next round's
    (Stage.RETRYING, Event.PUBLISHED): Stage.OPEN,
}


def transition(stage: Stage, event: Event) -> Stage:
    """The stage after ``event``; AssertionError for one that cannot happen there (a bug, not an input)."""
    try:
        return TRANSITIONS[(stage, event)]
    except KeyError:
        raise AssertionError(f"{event.value} cannot happen to a round's update in stage {stage.value}") from None


class Confirmation(enum.Enum):
    """What a tentative stream of a round's update is told after its entries."""

    WAIT = "wait"
    DURABLE = "durable"
    """Saved and published: the island may install it."""
    BROKEN = "broken"
    """Its save failed (retried; the island pulls again)."""


@dataclass
class Sealed:
    """A closed round (or θ_0) whose θ is computed and waits to be saved; it takes no more pushes."""

    round: int
    """The round that closed (:data:`BOOTSTRAP` for θ_0); publishing it opens ``round + 1``."""
    params: dict[str, torch.Tensor]
    payloads: dict[str, bytearray] | None
    """The encoded outer update (None for θ_0: islands pull the full θ)."""
    record: RoundRecord | None
    """The round's history record (None for θ_0)."""
    islands: frozenset[str]
    """Islands whose push counted (pulls answer committed=True for them meanwhile)."""
    retry_in: float = SAVE_RETRY_SECONDS[0]
    failures: int = 0


class Producing:
    """A round's outer update while the outer step makes it, tensor by tensor (in a worker thread):
    pulls send each payload as soon as it is final, the step's time overlapping the transfer."""

    def __init__(self, round_: int, sizes: dict[str, int], loss: float | None) -> None:
        self.round = round_
        self.loss = loss
        """The round's loss (the islands' mean), for the pulls' headers."""
        self.sizes = sizes
        """Each tensor's payload bytes (declared in the pull's header before it exists)."""
        self.payloads: dict[str, bytearray] = {}
        self._loop = asyncio.get_running_loop()
        self._made = {name: asyncio.Event() for name in sizes}

    def made(self, name: str, payload: bytearray) -> None:
        """From the step's thread: ``name``'s payload is final."""
        if len(payload) != self.sizes[name]:  # pragma: no cover - a codec that misstates its size
            raise AssertionError(f"{name}: {len(payload)} bytes made, {self.sizes[name]} declared")
        self.payloads[name] = payload
        self._loop.call_soon_threadsafe(self._made[name].set)

    def end(self) -> None:
        """The step ended: streams still waiting for a tensor it did not make (it failed) end."""
        for event in self._made.values():
            event.set()

    def entries(self, regions) -> list[PayloadEntry]:
        """A pull's entries of whole tensors (``regions``: (name, None) pairs), each sent once made."""
        return [PayloadEntry(name, None, self.sizes[name], None, partial(self.payload, name)) for name, _ in regions]

    async def payload(self, name: str) -> bytearray:
        """``name``'s payload, once it is made."""
        await self._made[name].wait()
        if name not in self.payloads:  # a failed step, or a relay's that ended in θ itself: pull again
            raise refuse(Reason.NOT_DURABLE, f"the outer step of round {self.round} ended before {name}")
        return self.payloads[name]


class Ledger:
    def __init__(self, now: float) -> None:
        self.round = 0
        """The open round: rounds below it are complete (θ is θ_round)."""
        self.opened_at = now
        self.history: list[RoundRecord] = []
        """One record per closed round."""
        self.stage = Stage.OPEN
        """The stage of the open round's update (θ_0's before the first round)."""
        self.sealed: Sealed | None = None
        self.producing: Producing | None = None
        """The open round's update while its outer step makes it (then it is sealed)."""
        self.round_changed = asyncio.Event()
        """Set (and replaced) when a round is sealed or published, or its step starts: wakes the long-polls."""
        self.poke = asyncio.Event()
        """Set when anything the decider looks at changed."""

    def complete(self, total_rounds: int) -> bool:
        return bool(total_rounds) and self.round >= total_rounds

    def committed_before(self, island_id: str, round_: int) -> bool:
        """Whether ``island_id``'s push for the closed round ``round_`` counted: committed in it, or
        folded late into a later round."""
        if not 0 <= round_ < len(self.history):
            return False
        rec = self.history[round_]
        if island_id in rec.islands or island_id in (rec.relayed or {}):  # itself, or in a relay's push
            return True
        return any([island_id, round_] in rec.late for rec in self.history[round_ + 1 :])

    def loss_of(self, round_: int) -> float | None:
        """The islands' mean loss of the closed round ``round_`` (None: unknown)."""
        return self.history[round_].loss if 0 <= round_ < len(self.history) else None

    def tokens_per_step(self) -> float | None:
        """Tokens per inner step of the last closed round's islands that reported both (None: unknown)."""
        if not self.history:
            return None
        last = self.history[-1]
        return tokens_per_step((tokens, last.steps_by_island.get(i)) for i, tokens in last.tokens_by_island.items())

    def advance(self, sealed: Sealed, now: float) -> None:
        """The sealed round is saved: open the next one and wake whoever waits for it."""
        self.stage = transition(self.stage, Event.PUBLISHED)
        if sealed.record is not None:
            self.history.append(sealed.record)
        self.round = sealed.round + 1
        self.sealed = None
        self.opened_at = now
        self.wake()
        self.poke.set()

    def seal(self, sealed: Sealed) -> None:
        """A round's θ is computed (it takes no more pushes and waits to be saved): the long-polls
        waiting for it stream its update now, tentatively (confirmed once it is saved)."""
        self.stage = transition(self.stage, Event.SEALED)
        self.sealed = sealed
        if sealed.payloads is not None:
            self.wake()

    def save_failed(self) -> None:
        """The sealed round's save failed (it is retried): its tentative streams end unconfirmed."""
        self.stage = transition(self.stage, Event.SAVE_FAILED)
        self.sealed.failures += 1
        self.wake()

    def streams(self, round_: int) -> bool:
        """Whether a pull waiting for ``round_``'s update may stream it now, tentatively: while its step
        makes it (:attr:`producing`) or its first save is under way (:attr:`sealed`)."""
        if round_ != self.round:
            return False
        if self.stage is Stage.MAKING:
            return self.producing is not None
        return self.stage is Stage.SAVING and self.sealed.payloads is not None

    def confirmation(self, round_: int) -> Confirmation:
        """What a tentative stream of ``round_``'s update is told now."""
        if self.round > round_:
            return Confirmation.DURABLE
        return Confirmation.BROKEN if self.stage is Stage.RETRYING else Confirmation.WAIT

    @contextlib.contextmanager
    def producing_step(
        self, round_: int, sizes: dict[str, int] | None, loss: float | None
    ) -> Iterator[Callable[[str, bytearray], None] | None]:
        """While the open round's outer step runs: the long-polls stream its update as it is made.
        Gives the step's ``made(name, payload)`` (None when the codec cannot say its sizes beforehand)."""
        if sizes is None:
            yield None
            return
        self.stage = transition(self.stage, Event.STEP)
        self.producing = Producing(round_, sizes, loss)
        self.wake()
        try:
            yield self.producing.made
        except BaseException:  # the step failed: the round is open as before
            self.stage = transition(self.stage, Event.STEP_ENDED)
            raise
        finally:
            self.producing.end()
            self.producing = None

    def wake(self) -> None:
        """Wake the long-polls (``round_changed`` is set and replaced)."""
        self.round_changed.set()
        self.round_changed = asyncio.Event()
