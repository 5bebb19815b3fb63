"""An island's side of a call striped over several bulk-port connections (:mod:`atoll.protos.bulk`):
units (offset, length, bytes) written and read by one thread per connection, each as fast as its TCP
stream goes, so a stream that falls behind holds back only its own units.

- :class:`UnitSender`: a push's data; a connection's thread takes the next unit once the lowest unit
  still being written is less than ``WINDOW_BYTES`` behind it.
- :class:`UnitReceiver`: a pull's data, put back in order; units further than ``AHEAD_BYTES`` past
  what the island has in full wait unread in their connections.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable

from atoll.protos import bulk
from atoll.protos.bulk import AHEAD_BYTES, END, UNIT, UNIT_BYTES, UnitQueue


class UnitSender:
    """Writes units over ``socks``; a failure or ``stop()`` (the coordinator answered part way) is put
    in ``failed`` (an exception, or None for an answer to read), and the threads give up."""

    def __init__(self, socks: list[socket.socket], failed: list, stop: Callable[[], bool]) -> None:
        self._failed, self._stop = failed, stop
        self._cond = threading.Condition()
        self._units = UnitQueue(len(socks))
        self._lanes = [
            threading.Thread(target=self._lane, args=(sock,), name="atoll-bulk-lane", daemon=True) for sock in socks
        ]
        for lane in self._lanes:
            lane.start()

    def put(self, offset: int, unit: memoryview) -> bool:
        """Queue a unit (waits while 2 per connection are queued); False once the call failed."""
        with self._cond:
            self._cond.wait_for(lambda: self._units.has_room() or self._failed)
            if self._failed:
                return False
            self._units.queued.append((offset, unit))
            self._cond.notify_all()
            return True

    def close(self) -> None:
        """Every queued unit written and each connection's units ended (or the call failed)."""
        with self._cond:
            self._units.closing = True
            self._cond.notify_all()
        for lane in self._lanes:
            lane.join()

    def _give_up(self, why) -> None:
        with self._cond:
            if not self._failed:
                self._failed.append(why)
            self._cond.notify_all()

    def _lane(self, sock: socket.socket) -> None:
        try:
            while True:
                with self._cond:
                    self._cond.wait_for(lambda: self._failed or self._units.ready())
                    if self._failed:
                        return
                    if (taken := self._units.take()) is None:
                        break
                    offset, unit = taken
                    self._cond.notify_all()
                if self._stop():
                    self._give_up(None)  # refused part way: the answer is read on the lead
                    return
                sock.sendall(UNIT.pack(offset, unit.nbytes))
                sock.sendall(unit)
                del unit
                with self._cond:
                    self._units.written(offset)
                    self._cond.notify_all()
            sock.sendall(UNIT.pack(END, 0))
        except OSError as err:
            self._give_up(bulk.broken(f"{type(err).__name__}: {err}"))


class UnitReceiver:
    """Reads units from ``socks`` (one thread each) and gives the data back in order."""

    def __init__(self, socks: list[socket.socket], start: int = 0) -> None:
        """``start``: the offset the data begins at (a resumed pull's)."""
        self._cond = threading.Condition()
        self._pending: dict[int, memoryview] = {}
        self._frontier = start
        self._ended = 0
        self._error: BaseException | None = None
        self._closed = False
        self._readers = [
            threading.Thread(target=self._read, args=(sock,), name="atoll-bulk-reader", daemon=True) for sock in socks
        ]
        for reader in self._readers:
            reader.start()

    def read_into(self, view: memoryview) -> None:
        """Fill ``view`` with the data's next bytes."""
        filled = 0
        while filled < view.nbytes:
            with self._cond:
                while (unit := self._pending.pop(self._frontier, None)) is None:
                    if self._error is not None:
                        raise self._error
                    if self._ended == len(self._readers):
                        raise bulk.broken("the striped call's connections ended before its data did")
                    self._cond.wait()
                n = min(unit.nbytes, view.nbytes - filled)
                view[filled : filled + n] = unit[:n]
                if n < unit.nbytes:
                    self._pending[self._frontier + n] = unit[n:]
                self._frontier += n
                filled += n
                self._cond.notify_all()

    @property
    def frontier(self) -> int:
        """The offset up to which the caller has the data."""
        return self._frontier

    def join_lead(self) -> None:
        """Wait until the lead connection's units ended (its next frame is the call's, not a unit)."""
        self._readers[0].join()
        if self._error is not None:
            raise self._error

    def settle(self, seconds: float) -> bool:
        """After the whole answer was read: wait (at most ``seconds`` each) for every connection's
        units to end; whether each did, with nothing left unread (the connections may be kept)."""
        for reader in self._readers:
            reader.join(seconds)
        with self._cond:
            return self._ended == len(self._readers) and self._error is None and not self._pending

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def _read(self, sock: socket.socket) -> None:
        try:
            while True:
                offset, length = UNIT.unpack(bulk.recv_exact(sock, UNIT.size))
                if offset == END:
                    break
                if not 0 < length <= UNIT_BYTES or offset < self._frontier:
                    raise bulk.broken(f"a striped call's unit out of place (offset {offset}, {length} bytes)")
                with self._cond:
                    self._cond.wait_for(lambda at=offset: at < self._frontier + AHEAD_BYTES or self._closed)
                    if self._closed:
                        return
                unit = memoryview(bytearray(length))
                bulk.recv_into(sock, unit)
                with self._cond:
                    self._pending[offset] = unit
                    self._cond.notify_all()
        except Exception as err:  # a BulkError: the connection broke or timed out
            with self._cond:
                if self._error is None and not self._closed:
                    self._error = err
                self._cond.notify_all()
            return
        with self._cond:
            self._ended += 1
            self._cond.notify_all()
