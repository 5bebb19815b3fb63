"""What the coordinator writes to its state dir, and when: the one owner of that sequence.

- before θ_0 is published: its snapshot;
- before a round is published: its log record (:func:`atoll.coordinator.disk.wal.append`), small, most of
  it written while the outer step makes the update (:meth:`StateWriter.streaming`);
- after a publish, in the background while the next round runs: the round now published
  (:func:`snapshots.write_head`), the optimizer state of the new θ, or, every ``every`` rounds, a
  full snapshot; then the files no longer needed are pruned.

The next outer step waits (:meth:`StateWriter.wait`) for the background write, since it changes
momentum and error feedback in place; θ itself is never changed in place.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Iterator
from pathlib import Path

from atoll.coordinator.config import RunConfig
from atoll.coordinator.disk import snapshots, wal
from atoll.coordinator.disk.store import LocalState, StateStore
from atoll.coordinator.disk.upload import RecordUpload

log = logging.getLogger("atoll.coordinator")


class StateWriter:
    def __init__(
        self, state_dir: Path, *, every: int, keep: int, store: StateStore | None = None, exact: bool = False
    ) -> None:
        """``store``: where the state is kept, ``state_dir`` its dir or working copy (default: the dir).
        ``exact``: a round's optimizer state is in the store *before* its θ is published, not just after
        (``--exact-failover``: a standby that takes over continues bitwise whenever the primary dies)."""
        if every < 1:
            raise ValueError(f"snapshot_every must be >= 1, got {every}")
        self.state_dir, self.every, self.keep = Path(state_dir), every, keep
        self.snapshot_round = 0
        """θ's round in the newest snapshot on disk (or being written)."""
        self.failed: str | None = None
        """Why the last background write failed (None: it worked); the next publish writes a snapshot."""
        self._thread: threading.Thread | None = None
        self._stream: wal.RecordStream | None = None
        """The record of the round being stepped, written as its update is made."""
        self._upload: RecordUpload | None = None
        """The same record going up to the store as it is made (an object store's)."""
        self.store = store or LocalState()
        """Where the state is kept: a record is durable once it is there, the background's files follow it."""
        self.exact = exact
        self._optimizer_round = -1
        """The round whose optimizer file :meth:`log_round` wrote already (``exact``)."""

    @property
    def trouble(self) -> str | None:
        """Why the state is not being kept as it should (a background write failing, the store's lease or
        uploads in trouble); None when it is."""
        if self.store.trouble is not None:
            return self.store.trouble
        return None if self.failed is None else f"the background checkpoint fails ({self.failed})"

    def restored(self) -> None:
        """After a restore: the newest snapshot is the one on disk."""
        self.snapshot_round = snapshots.read_round(snapshots.snapshot_paths(self.state_dir)[-1])

    # ---- before a publish (a worker thread; raises when the write fails) ------------------------
    def bootstrap(self, snap: snapshots.Snapshot) -> None:
        snapshots.save(self.state_dir, snap, keep=None)
        self.store.sync()

    def log_round(
        self,
        round_: int,
        payloads: dict,
        record: dict,
        islands: dict,
        config: RunConfig,
        optimizer: dict | None = None,
    ) -> None:
        """Make round ``round_`` durable: its record in the store. ``optimizer``: with ``exact``, the
        optimizer state the step made (that of θ_{round_+1}), in the store first."""
        if self.exact and optimizer is not None:
            wal.write_optimizer(self.state_dir, round_ + 1, optimizer, before_record=True)
            self.store.put_now(self.state_dir / wal.LOG / wal.optimizer_name(round_ + 1))
            self._optimizer_round = round_ + 1
        stream, self._stream = self._stream, None
        upload, self._upload = self._upload, None
        try:
            wal.append(self.state_dir, round_, payloads, record, islands, config, stream=stream)
        except BaseException:
            if upload is not None:
                self.store.abandon_record(upload)
            raise
        finally:
            if stream is not None:
                stream.abandon()  # finished or not: nothing of it is left behind
        streamed = upload if stream is not None and stream.finished else None  # (sent while the step ran)
        if upload is not None and streamed is None:
            self.store.abandon_record(upload)
        self.store.put_record(self.state_dir / wal.record_rel(round_), upload=streamed)  # durable once there

    @contextlib.contextmanager
    def streaming(self, round_: int, made, head_hint: int | None) -> Iterator:
        """While round ``round_``'s step runs: ``made`` that also sends each payload to the round's
        record as it is made (:class:`wal.RecordStream`); the record is finished by :meth:`log_round`,
        or abandoned if the step fails. ``head_hint`` None: ``made`` as it is (the record is written
        whole)."""
        if made is None or head_hint is None:
            yield made
            return
        self._drop_stream()
        stream = self._stream = wal.RecordStream(self.state_dir, round_, head_hint)
        upload = self._upload = self.store.stream_record(wal.record_rel(round_), stream.head_bytes)  # (or none)

        def both(name: str, payload) -> None:
            stream.add(name, payload)
            if upload is not None:
                upload.add(payload)
            made(name, payload)

        try:
            yield both
        except BaseException:
            self._drop_stream()
            raise

    # ---- after a publish ------------------------------------------------------------------------
    def after_publish(self, snap: snapshots.Snapshot, keep_from: int) -> None:
        """Write ``snap``'s optimizer state, or all of it when a snapshot is due, in the background;
        keep log records from ``keep_from`` on (catch-ups read them)."""
        self.wait()
        full = snap.round - self.snapshot_round >= self.every or self.failed is not None
        if full:
            self.snapshot_round = snap.round
        newest = self.snapshot_round

        def write() -> None:
            snapshots.write_head(self.state_dir, snap.round)
            if full:
                snapshots.save(self.state_dir, snap, keep=self.keep)
            elif snap.round != self._optimizer_round:  # (with ``exact``: written before the publish)
                wal.write_optimizer(self.state_dir, snap.round, snap.extra)
            wal.prune(self.state_dir, snapshot_round=newest, keep_from=keep_from)
            self.store.sync_later()  # (an object store's: up in the background, the next step does not wait)

        self._thread = threading.Thread(target=self._run, args=(write,), name="atoll-checkpoints", daemon=True)
        self._thread.start()

    def _run(self, write) -> None:
        try:
            write()
            self.failed = None
        except Exception as err:  # every round is still in the log; the next publish writes a snapshot
            self.failed = str(err)
            log.error("the background checkpoint failed: %s (the log keeps every round; retried)", err)

    def close(self) -> None:
        """The server stops: the background write finishes, a record being streamed is dropped (its
        round was never published)."""
        self.wait()
        self._drop_stream()
        self.store.close()  # (an object store's lease given back)

    def _drop_stream(self) -> None:
        """The record being streamed will not be this round's (the step failed, or the server stops)."""
        stream, self._stream = self._stream, None
        upload, self._upload = self._upload, None
        if stream is not None:
            stream.abandon()
        if upload is not None:
            self.store.abandon_record(upload)

    def wait(self) -> None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None
