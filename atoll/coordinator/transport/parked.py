"""A push being received, from its admission to its end (:class:`InboundPush`), and the pushes cut
part way, kept so that their retry resumes where they broke (the bulk port).

An inbound push holds what the coordinator admitted for it (its plan, the in-flight budget it
reserved with its (island, rank) stream) and what arrived (the entries complete and checked, and the
bytes of the one being filled); it is the one owner of all of that until it commits, is refused, or
is parked. A push whose connection breaks (a reset, an end before its declared bytes, a stall past
the idle limit) after some of its data arrived is parked whole. Its retry, the same header from the
same island, is told how many bytes the coordinator has (the CONTINUE frame) and sends only the rest.
A parked push goes when its retry takes it, when another push of its island and rank comes (it gives
way), or after ``seconds``, whichever is first; then its memory and budget go back.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass

from atoll.coordinator.run.run_state import RunState
from atoll.coordinator.state.budget import Reservation
from atoll.coordinator.state.plans import PushPlan, Received
from atoll.protos.rpc import EntryAssembler


@dataclass
class InboundPush:
    header: bytes
    """The push's serialised header: a retry must carry the same."""
    plan: PushPlan
    reservation: Reservation
    """Its declared bytes against the in-flight budget, and its (island, rank) stream."""
    assembler: EntryAssembler
    """The bytes of its entries as they arrive."""
    received: Received
    """Its entries complete and checked."""

    @classmethod
    def admitted(cls, state: RunState, header: bytes, plan: PushPlan) -> InboundPush:
        """A push ``state`` planned: its stream opened and its bytes reserved (or refused, raised)."""
        reservation = state.open_stream(plan)
        assembler = EntryAssembler([e.num_bytes for e in plan.entries], state.accumulator.buffers)
        return cls(header, plan, reservation, assembler, Received())

    @property
    def consistent(self) -> bool:
        """Every entry complete is checked (it was not cut while one was being checked): it can resume."""
        return len(self.received.payloads) == self.assembler.index

    def drop_data(self) -> None:
        """Its bytes and its share of the in-flight budget back (refused, or parked too long)."""
        self.assembler.discard()
        self.received.payloads.clear()
        self.reservation.release()

    def end(self, state: RunState) -> None:
        """Its stream closed: another push of its island and rank may come."""
        state.close_stream(self.plan)


class ParkedPushes:
    """Parked pushes by (island, rank); ``release(push)`` gives one's memory and budget back."""

    def __init__(self, seconds: float, release: Callable[[InboundPush], None]) -> None:
        self.seconds = seconds
        self._release = release
        self._by: dict[tuple[str, int], tuple[InboundPush, asyncio.TimerHandle]] = {}

    @property
    def holding(self) -> int:
        return len(self._by)

    def park(self, key: tuple[str, int], push: InboundPush) -> None:
        self.drop(key)
        self._by[key] = (push, asyncio.get_running_loop().call_later(self.seconds, self.drop, key))

    def take(self, key: tuple[str, int], header: bytes) -> InboundPush | None:
        """The push parked for ``key`` if ``header`` is its own (its retry); any other parked push of that
        island and rank is released (a new push takes its place)."""
        held = self._by.get(key)
        if held is None:
            return None
        if held[0].header != header:
            self.drop(key)
            return None
        del self._by[key]
        held[1].cancel()
        return held[0]

    def drop(self, key: tuple[str, int]) -> None:
        held = self._by.pop(key, None)
        if held is not None:
            held[1].cancel()
            self._release(held[0])

    def close(self) -> None:
        for key in list(self._by):
            self.drop(key)
