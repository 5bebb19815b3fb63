"""One writer per state dir: a coordinator, or an operator's tool that changes the dir (``atoll rollback``)."""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

from atoll.coordinator.disk.snapshots import StateError

LOCK = ".lock"


class StateLock:
    """One writer per state dir: an exclusive ``flock`` on the state dir itself, which the kernel
    releases when the process dies (a SIGKILLed coordinator leaves no stale lock) and which no file
    operation can remove from under its holder (a lock on ``STATE_DIR/.lock`` was gone once the file
    was deleted). ``.lock`` only says who holds it: ``acquire`` raises StateError naming that pid."""

    def __init__(self, state_dir: Path) -> None:
        self.path = Path(state_dir) / LOCK
        self._fd: int | None = None

    def acquire(self, what: str) -> StateLock:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path.parent, os.O_RDONLY | os.O_DIRECTORY)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            try:
                holder = "process " + (self.path.read_text(errors="replace").strip() or "unknown")
            except OSError:
                holder = f"another process ({LOCK}, which names it, was removed)"
            raise StateError(
                f"{self.path.parent} is in use by {holder} (a coordinator or an atoll tool); stop it before {what}"
            ) from None
        self._fd = fd
        self.path.write_text(f"{os.getpid()}\n")
        return self

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the descriptor drops the flock
            self._fd = None
