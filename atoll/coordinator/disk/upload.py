"""A log record that goes up to the object store while the outer step makes it.

With ``--state-dir s3://...`` a round is durable once its record is in the store, and a record is the
round's whole encoded update (166 MB at 124M int8). Put after the step, all of it waits on the
critical path of every round. :class:`RecordUpload` sends it as the step makes it instead, as a
multipart upload: the step hands each payload over as it is final (the same calls that stream the
record to the local disk, :class:`~atoll.coordinator.disk.wal.RecordStream`), a thread cuts them into
parts and puts them, and making the round durable after the step sends only what is left: the first
part (the header, which is known only then, with the first bytes of the data: S3 takes no part but
the last under 5 MiB) and the last one, then completes the upload create-only (the records' fence,
as for a whole PUT).

The object is byte for byte the local record file (its header read back from that file), so a
coordinator that restores from the store reads it as it would the disk's. Any failure on the way
(the store refused a part, the step wrote the record another way) is the caller's to see in
:meth:`RecordUpload.finish`: it then puts the record whole, as before. An upload abandoned (the step
failed, the coordinator stopped) is aborted; one cut by a crash is left incomplete in the store,
where no reader lists it (a bucket rule that aborts incomplete multipart uploads after a day removes
its parts).
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
from concurrent.futures import Future, ThreadPoolExecutor

from atoll.objects import ObjectStore, StoreError

log = logging.getLogger("atoll.coordinator")

FIRST_BYTES = 5 << 20
"""Data bytes held back for the first part, which goes last with the header (S3's smallest part)."""
PART_BYTES = 8 << 20
"""The parts in between, put as soon as each is whole; the last one, put at the end, is smaller."""
IN_FLIGHT = 2
"""Parts put at once while the step runs."""


class RecordUpload:
    """``rel`` as a multipart upload whose data (everything after its first ``head_bytes``) comes by
    :meth:`add` in order, and whose head comes last with :meth:`finish`."""

    def __init__(self, store: ObjectStore, rel: str, head_bytes: int) -> None:
        self.store, self.rel, self.head_bytes = store, rel, head_bytes
        self.size = head_bytes
        """Bytes of the object so far: the head, then every payload added."""
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._first = bytearray()
        self._part = bytearray()
        self._parts: list[Future] = []
        self._pool = ThreadPoolExecutor(IN_FLIGHT, thread_name_prefix="atoll-record-part")
        self._upload: str | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._cut, name="atoll-record-up", daemon=True)
        self._thread.start()

    def add(self, payload) -> None:
        """The next bytes of the record's data (they must not change until :meth:`finish` returns)."""
        self.size += memoryview(payload).nbytes
        self._queue.put(payload)

    def finish(self, head: bytes, size: int) -> str:
        """Put the head with the first data bytes and the rest not yet up, and complete the upload
        create-only; its ETag. ``size``: the local file's, which this object must equal. StoreError
        (Conflict: the record exists) after aborting the upload; nothing is then left in the store."""
        self._queue.put(None)
        self._thread.join()
        try:
            if self._error is not None:
                raise self._error
            if len(head) != self.head_bytes or size != self.size:
                raise StoreError(f"{self.store.url}/{self.rel}: the record on disk is not the one sent ({size} bytes)")
            upload = self._begin()
            first = self._pool.submit(self._put, upload, 1, bytes(head) + bytes(self._first))
            if self._part:
                self._parts.append(self._pool.submit(self._put, upload, len(self._parts) + 2, self._part))
            parts = [first.result(), *(f.result() for f in self._parts)]
            etag = self.store.complete_parts(self.rel, upload, parts, create_only=True)
            self._upload = None  # complete: nothing to abort
            return etag
        except BaseException:
            self.abandon()
            raise
        finally:
            self._pool.shutdown(wait=True)

    def abandon(self) -> None:
        """Stop, and abort the upload (its parts go)."""
        if self._thread.is_alive():
            self._error = self._error or StoreError("abandoned")
            self._queue.put(None)
            self._thread.join()
        for f in self._parts:
            with contextlib.suppress(BaseException):
                f.result()
        self._pool.shutdown(wait=True)
        upload, self._upload = self._upload, None
        if upload is not None:
            self.store.abort_parts(self.rel, upload)

    # ---- the thread that cuts parts ---------------------------------------------------------------
    def _cut(self) -> None:
        while (payload := self._queue.get()) is not None:
            if self._error is not None:
                continue  # drain: the upload is abandoned
            try:
                data = memoryview(payload).cast("B")
                take = min(FIRST_BYTES - len(self._first), data.nbytes)
                self._first += data[:take]
                data = data[take:]
                while data.nbytes:
                    take = min(PART_BYTES - len(self._part), data.nbytes)
                    self._part += data[:take]
                    data = data[take:]
                    if len(self._part) == PART_BYTES:
                        self._send(self._part)  # (never changed again: the next part is a new buffer)
                        self._part = bytearray()
            except BaseException as err:  # raised by finish()
                self._error = err

    def _send(self, body: bytearray) -> None:
        """Put one whole part in between (numbered from 2: part 1 is the head's), at most IN_FLIGHT at once."""
        upload = self._begin()
        while len([f for f in self._parts if not f.done()]) >= IN_FLIGHT:
            next(f for f in self._parts if not f.done()).result()
        for f in self._parts:
            if f.done() and f.exception() is not None:
                raise f.exception()
        self._parts.append(self._pool.submit(self._put, upload, len(self._parts) + 2, body))

    def _begin(self) -> str:
        if self._upload is None:
            self._upload = self.store.begin_parts(self.rel)
        return self._upload

    def _put(self, upload: str, number: int, body) -> dict:
        return self.store.put_part(self.rel, upload, number, body)
