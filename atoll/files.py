"""Writing a file so that it is whole or absent after a crash: a temporary file beside it, fsynced,
renamed over it, the directory fsynced. Shared by the coordinator's state (snapshots, the log, the
membership file), an island's checkpoints and the port files.

Durable writes go out with O_DIRECT through one page-aligned bounce buffer: the bytes reach the
device without filling the page cache first (through the page cache a durable write of 475 MiB
took 0.3 to 1.4 s on the dev machine, with O_DIRECT about 0.3 s, steadily)."""

from __future__ import annotations

import errno
import mmap
import os
import queue
import threading
from pathlib import Path

import numpy as np


def write_atomic(path: Path, parts: list, durable: bool = True) -> None:
    """Write the bytes of ``parts`` as ``path``, atomically: a temporary file beside it, fsynced (with
    O_DIRECT where the filesystem takes it), renamed over ``path``, the directory fsynced.
    ``durable=False``: renamed only, no fsync (a cache)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        if not (durable and _write_direct(tmp, parts)):
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                for part in parts:
                    _write_all(fd, part)
                if durable:
                    os.fsync(fd)
            finally:
                os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)  # the old file stays as it was; no partial one is left beside it
        raise
    if durable:
        fsync_dir(path.parent)


DIRECT_BLOCK = 4096
"""O_DIRECT alignment of memory, file offsets and lengths (the common logical block size or a multiple)."""
BOUNCE_BYTES = 16 << 20


def _write_direct(path: Path, parts: list) -> bool:
    """Write ``parts`` to ``path`` with O_DIRECT through one aligned buffer, then fsync. False, having
    written nothing that stays, where the filesystem refuses O_DIRECT (tmpfs); the caller then writes
    through the page cache."""
    fd = _open_direct(path)
    if fd is None:
        return False
    try:
        size = sum(memoryview(part).nbytes for part in parts)
        bounce = _Bounce(fd, 0, min(BOUNCE_BYTES, max(whole_blocks(size), DIRECT_BLOCK)))  # no larger than needed
        for part in parts:
            bounce.add(part)
        bounce.close()
        os.ftruncate(fd, size)
        os.fsync(fd)
        return True
    except OSError as err:
        if err.errno != errno.EINVAL:
            raise
        return False  # the filesystem takes O_DIRECT opens but not its writes
    finally:
        os.close(fd)


def _write_all(fd: int, data) -> None:
    view = memoryview(data).cast("B")
    while view.nbytes:
        view = view[os.write(fd, view[: 1 << 30]) :]


def whole_blocks(n: int) -> int:
    """``n`` rounded up to whole O_DIRECT blocks."""
    return -(-n // DIRECT_BLOCK) * DIRECT_BLOCK


def _open_direct(path: Path) -> int | None:
    """A fresh file at ``path`` opened for O_DIRECT writes, or None where there is no O_DIRECT."""
    flag = getattr(os, "O_DIRECT", 0)
    if not flag:
        return None
    try:
        return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | flag, 0o644)
    except OSError:
        return None


class _Bounce:
    """One page-aligned buffer of ``size`` bytes (a multiple of ``DIRECT_BLOCK``) through which bytes
    go to an O_DIRECT ``fd`` from offset ``at`` on, in whole blocks; :meth:`close` writes the last,
    partial one padded with zeros (the caller truncates the file to its size)."""

    def __init__(self, fd: int, at: int, size: int = BOUNCE_BYTES) -> None:
        self.fd, self.at, self.filled = fd, at, 0
        self.mem = mmap.mmap(-1, size)  # page-aligned
        self.buf = np.frombuffer(self.mem, dtype=np.uint8)

    def add(self, part) -> None:
        data = np.frombuffer(part, dtype=np.uint8)
        while data.size:
            take = min(self.buf.size - self.filled, data.size)
            self.buf[self.filled : self.filled + take] = data[:take]
            self.filled, data = self.filled + take, data[take:]
            if self.filled == self.buf.size:
                _pwrite_all(self.fd, self.mem, self.at)
                self.at, self.filled = self.at + self.filled, 0

    def close(self) -> None:
        if self.filled:
            whole = whole_blocks(self.filled)
            self.buf[self.filled : whole] = 0
            _pwrite_all(self.fd, memoryview(self.mem)[:whole], self.at)
            self.at, self.filled = self.at + whole, 0


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class StreamedFile:
    """A file written while its bytes are still being made, then made whole-or-absent like
    :func:`write_atomic`: its parts are appended (from any thread) and a writer thread takes them to
    a temporary file beside ``path`` (O_DIRECT through one aligned bounce buffer where the filesystem
    takes it), so by :meth:`finish` most bytes are already on the device. The first ``head_bytes``
    (a multiple of ``DIRECT_BLOCK``) are left for a header that is known only at the end.

    A part must not change until :meth:`finish` or :meth:`abandon` returns. Any write error is
    raised by :meth:`finish`, which then leaves no file (nor does :meth:`abandon`)."""

    def __init__(self, path: Path, head_bytes: int) -> None:
        if head_bytes <= 0 or head_bytes % DIRECT_BLOCK:
            raise ValueError(f"head_bytes must be a positive multiple of {DIRECT_BLOCK}, got {head_bytes}")
        self.path, self.head_bytes = Path(path), head_bytes
        self.tmp = self.path.with_name(f".{self.path.name}.tmp")
        self.size = head_bytes
        """Bytes of the file so far: the head, then every part appended."""
        self._parts: queue.SimpleQueue = queue.SimpleQueue()
        self._error: BaseException | None = None
        self._fd, self._direct = _open_for_stream(self.tmp)
        self._thread = threading.Thread(target=self._write, name="atoll-record", daemon=True)
        self._thread.start()

    def append(self, part) -> None:
        """Queue ``part``'s bytes after those appended before."""
        self.size += memoryview(part).nbytes
        self._parts.put(part)

    def finish(self, head: bytes) -> None:
        """Write ``head`` (exactly ``head_bytes``) first, fsync, rename, fsync the directory."""
        if len(head) != self.head_bytes:
            self.abandon()
            raise ValueError(f"a head of {len(head)} bytes for {self.head_bytes} reserved")
        self._parts.put(None)
        self._thread.join()
        try:
            if self._error is not None:
                raise self._error
            os.pwrite(self._fd, _aligned_copy(head) if self._direct else head, 0)
            os.ftruncate(self._fd, self.size)  # O_DIRECT wrote the last block whole
            os.fsync(self._fd)
            os.close(self._fd)
            self._fd = -1
            os.replace(self.tmp, self.path)
        except BaseException:
            self.abandon()
            raise
        fsync_dir(self.path.parent)

    def abandon(self) -> None:
        """Stop and leave no file."""
        if self._thread.is_alive():
            self._error = self._error or RuntimeError("abandoned")
            self._parts.put(None)
            self._thread.join()
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        self.tmp.unlink(missing_ok=True)

    def _write(self) -> None:
        """The writer thread: each part at its place, through the bounce buffer when O_DIRECT."""
        at = self.head_bytes
        bounce = _Bounce(self._fd, at) if self._direct else None
        while (part := self._parts.get()) is not None:
            if self._error is not None:
                continue  # drain: the file is abandoned
            try:
                if bounce is not None:
                    bounce.add(part)
                else:
                    _pwrite_all(self._fd, part, at)
                    at += memoryview(part).nbytes
            except BaseException as err:  # raised by finish()
                self._error = err
        if bounce is not None and self._error is None:
            try:
                bounce.close()
            except BaseException as err:
                self._error = err


def _open_for_stream(path: Path) -> tuple[int, bool]:
    """(fd, O_DIRECT?) of a fresh temporary file."""
    fd = _open_direct(path)
    if fd is not None:
        return fd, True
    return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644), False


def _aligned_copy(data: bytes) -> mmap.mmap:
    out = mmap.mmap(-1, len(data))  # page-aligned
    out[:] = data
    return out


def _pwrite_all(fd: int, data, at: int) -> None:
    view = memoryview(data).cast("B")
    while view.nbytes:
        n = os.pwrite(fd, view[: 1 << 30], at)
        view, at = view[n:], at + n
