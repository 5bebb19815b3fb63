"""Pushes cut part way, kept so that their retry resumes where they broke (the bulk port).

A push whose connection breaks (a reset, an end before its declared bytes, a stall past the idle
limit) after some of its data arrived is parked with what it holds: its admission (the in-flight
budget it reserved, its (island, rank) stream), the entries already complete and checked, and the
bytes of the one it was filling. Its retry, the same header from the same island, is told how many
bytes the coordinator has (the CONTINUE frame) and sends only the rest. A parked push goes when its
retry takes it, when another push of its island and rank comes (it gives way), or after
``seconds``, whichever is first; then its memory and budget go back.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass


@dataclass
class Parked:
    header: bytes
    """The push's serialised header: its retry must carry the same."""
    plan: object
    reservation: object
    assembler: object
    received: object
    timer: asyncio.TimerHandle | None = None


class ParkedPushes:
    """Parked pushes by (island, rank); ``release(parked)`` gives one's memory and budget back."""

    def __init__(self, seconds: float, release: Callable[[Parked], None]) -> None:
        self.seconds = seconds
        self._release = release
        self._by: dict[tuple[str, int], Parked] = {}

    @property
    def holding(self) -> int:
        return len(self._by)

    def park(self, key: tuple[str, int], parked: Parked) -> None:
        self.drop(key)
        parked.timer = asyncio.get_running_loop().call_later(self.seconds, self.drop, key)
        self._by[key] = parked

    def take(self, key: tuple[str, int], header: bytes) -> Parked | None:
        """The push parked for ``key`` if ``header`` is its own (its retry); any other parked push of that
        island and rank is released (a new push takes its place)."""
        parked = self._by.get(key)
        if parked is None:
            return None
        if parked.header != header:
            self.drop(key)
            return None
        del self._by[key]
        parked.timer.cancel()
        return parked

    def drop(self, key: tuple[str, int]) -> None:
        parked = self._by.pop(key, None)
        if parked is not None:
            parked.timer.cancel()
            self._release(parked)

    def close(self) -> None:
        for key in list(self._by):
            self.drop(key)
