"""A call striped over several connections of the bulk port (:mod:`atoll.protos.bulk`): its connections
as they come in (:class:`StripeSet`), and its data (:class:`Striped`).

Each connection carries units (offset, length, bytes) in increasing order, and every connection is
read and written on its own, as fast as its TCP stream goes: a stream that falls behind (they share
one bottleneck unevenly) holds back only its own units, the others take more. The receiver puts the
units back in order (those ahead wait in memory, at most ``AHEAD_BYTES`` past what it has in full; a
unit further ahead waits unread in its connection); the sender starts a unit only within
``WINDOW_BYTES`` of the lowest one it is still writing.

A unit that overlaps another (one waiting, or bytes already taken) or lies past the call's declared
length (:meth:`Striped.bound`) is refused: the units held are then distinct bytes of the push, inside
what its header declared and its reservation of the in-flight budget covers (overlapping units were
all held: 384 MiB of them on a push declaring 4 MiB).
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import hmac

from atoll.coordinator.transport.connection import Connection
from atoll.protos.bulk import AHEAD_BYTES, END, UNIT, UNIT_BYTES, UnitQueue, cut_units


class StripeSet:
    """The connections of one striped call as they come in (the lead, index 0, and its sides, in any
    order): each must carry the same count and authorization as the first that came."""

    def __init__(self, count: int, auth: str) -> None:
        self.count, self.auth = count, auth
        self.conns: list[Connection | None] = [None] * count
        self.led = asyncio.Event()
        """The lead connection came (sides wait for it)."""
        self.attached = asyncio.Event()
        """Every connection came (the lead waits for them)."""
        self.finished = asyncio.Event()
        """The call ended (its sides close, or wait for their next call)."""
        self.clean = False
        """The call ended with every connection's data read to its end (they may carry another)."""

    def attach(self, index: int, conn: Connection, count: int, auth: str) -> None:
        if count != self.count or not 0 <= index < count or self.conns[index] is not None or self.finished.is_set():
            raise ValueError(f"connection {index} of a striped call of {count} does not fit the call")
        if not hmac.compare_digest(auth.encode(), self.auth.encode()):
            raise ValueError("a striped call's connections carry different authorizations")
        self.conns[index] = conn
        if index == 0:
            self.led.set()
        if all(c is not None for c in self.conns):
            self.attached.set()


class _Ahead:
    """The units that came ahead of the frontier, by offset, none overlapping another."""

    def __init__(self) -> None:
        self._starts: list[int] = []
        self._units: dict[int, memoryview] = {}

    def fits(self, offset: int, length: int) -> bool:
        """Whether ``[offset, offset + length)`` overlaps no unit held."""
        i = bisect.bisect_left(self._starts, offset)
        if i < len(self._starts) and self._starts[i] < offset + length:
            return False
        return i == 0 or self._starts[i - 1] + self._units[self._starts[i - 1]].nbytes <= offset

    def put(self, offset: int, unit: memoryview) -> None:
        bisect.insort(self._starts, offset)
        self._units[offset] = unit

    def pop(self, offset: int) -> memoryview | None:
        unit = self._units.pop(offset, None)
        if unit is not None:
            del self._starts[bisect.bisect_left(self._starts, offset)]
        return unit

    @property
    def held(self) -> int:
        return sum(u.nbytes for u in self._units.values())


class Striped:
    """One striped call's data on ``conns`` (the lead first; answers stay on the lead). Every
    connection's bytes advance the lead's progress clock."""

    delimited = True

    def __init__(self, conns: list[Connection]) -> None:
        self.conns = conns
        for conn in conns[1:]:
            conn.clock = conns[0]
        self._cond = asyncio.Condition()
        self._error: BaseException | None = None
        self._tasks: list[asyncio.Task] = []
        # receiving
        self._pending = _Ahead()
        self._frontier = 0
        self._ended = 0
        self._limit: int | None = None
        # sending
        self._units = UnitQueue(len(conns))
        self._offset = 0
        self._lanes: list[asyncio.Task] | None = None

    def begin(self, offset: int) -> None:
        """The data resumes at ``offset`` (the receiver holds what came before)."""
        self._frontier = self._offset = offset

    def bound(self, length: int) -> None:
        """The data received is ``length`` bytes in all (a push's declared payloads): no unit past it."""
        self._limit = length

    async def _fail(self, err: BaseException) -> None:
        async with self._cond:
            if self._error is None:
                self._error = err
            self._cond.notify_all()

    # ---- receiving ---------------------------------------------------------------------------
    def receive(self) -> None:
        """Start reading every connection's units (a push was told CONTINUE: its data, then each
        connection's END, are coming, even when the coordinator holds them all already)."""
        if not self._tasks:
            self._tasks = [asyncio.create_task(self._read(conn)) for conn in self.conns]

    async def recv_into(self, view: memoryview) -> int:
        """The next bytes of the data in order into ``view`` (at least one); EOFError when every
        connection ended first."""
        self.receive()
        async with self._cond:
            while (unit := self._pending.pop(self._frontier)) is None:
                if self._error is not None:
                    raise self._error
                if self._ended == len(self.conns):
                    raise EOFError("the striped call's connections ended before its data did")
                await self._cond.wait()
            n = min(unit.nbytes, view.nbytes)
            view[:n] = unit[:n]
            if n < unit.nbytes:
                self._pending.put(self._frontier + n, unit[n:])
            self._frontier += n
            self._cond.notify_all()
        return n

    async def _read(self, conn: Connection) -> None:
        try:
            while True:
                offset, length = UNIT.unpack(await conn.recv_exact(UNIT.size))
                if offset == END:
                    break
                self._check_unit(offset, length)
                async with self._cond:
                    await self._cond.wait_for(lambda at=offset: at < self._frontier + AHEAD_BYTES or self._error)
                unit = memoryview(bytearray(length))
                got = 0
                while got < length:
                    got += await conn.recv_into(unit[got:])
                async with self._cond:
                    self._check_unit(offset, length)  # (another connection's unit may have come meanwhile)
                    self._pending.put(offset, unit)
                    self._cond.notify_all()
        except (OSError, EOFError, ValueError) as err:
            await self._fail(err)
            return
        async with self._cond:
            self._ended += 1
            self._cond.notify_all()

    def _check_unit(self, offset: int, length: int) -> None:
        """ValueError unless the unit is new bytes of the call's data: after the frontier, inside its
        declared length, over no unit held."""
        past = self._limit is not None and offset + length > self._limit
        if not 0 < length <= UNIT_BYTES or offset < self._frontier or past or not self._pending.fits(offset, length):
            raise ValueError(
                f"a striped call's unit out of place (offset {offset}, {length} bytes: it overlaps another, "
                "or lies outside the declared data)"
            )

    @property
    def held(self) -> int:
        """Bytes of units waiting ahead of the frontier."""
        return self._pending.held

    # ---- sending -----------------------------------------------------------------------------
    async def send(self, data) -> None:
        """Queue ``data``'s units (the next bytes of the call's data); it is sent from its own memory,
        which must stay until :meth:`flush` returns."""
        self._start_lanes()
        for offset, unit in cut_units(self._offset, data):
            async with self._cond:
                await self._cond.wait_for(lambda: self._units.has_room() or self._error)
                if self._error is not None:
                    raise self._error
                self._units.queued.append((offset, unit))
                self._cond.notify_all()
            self._offset = offset + unit.nbytes

    async def flush(self) -> None:
        """Every unit written and every connection's units ended."""
        self._start_lanes()
        async with self._cond:
            self._units.closing = True
            self._cond.notify_all()
        await asyncio.gather(*self._lanes)
        if self._error is not None:
            raise self._error

    def _start_lanes(self) -> None:
        if self._lanes is None:
            self._lanes = [asyncio.create_task(self._lane(conn)) for conn in self.conns]

    async def _lane(self, conn: Connection) -> None:
        try:
            while True:
                async with self._cond:
                    await self._cond.wait_for(lambda: self._error is not None or self._units.ready())
                    if self._error is not None:
                        return
                    if (taken := self._units.take()) is None:
                        break
                    offset, unit = taken
                    self._cond.notify_all()
                await conn.send(UNIT.pack(offset, unit.nbytes))
                await conn.send(unit)
                del unit
                async with self._cond:
                    self._units.written(offset)
                    self._cond.notify_all()
            await conn.send(UNIT.pack(END, 0))
        except OSError as err:
            await self._fail(err)

    async def settle(self, seconds: float) -> bool:
        """After a call that ended well: wait (at most ``seconds``) for every connection's units to end,
        which the sender writes after its last unit; whether each did, with nothing left unread (the
        connections may then carry another call)."""
        if not self._tasks:
            return True  # nothing was read: a pull's, or a push answered at its header
        done, _ = await asyncio.wait(self._tasks, timeout=seconds)
        return len(done) == len(self._tasks) and self._error is None and self._ended == len(self.conns)

    async def close(self) -> None:
        """Stop reading and writing (the call ended, or failed)."""
        for task in [*self._tasks, *(self._lanes or [])]:
            task.cancel()
        for task in [*self._tasks, *(self._lanes or [])]:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        for conn in self.conns[1:]:
            conn.clock = conn
