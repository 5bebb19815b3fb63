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
from atoll.coordinator.disk.mirror import Mirror

log = logging.getLogger("atoll.coordinator")


class StateWriter:
    def __init__(self, state_dir: Path, *, every: int, keep: int) -> None:
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
        self.mirror: Mirror | None = None
        """The store this dir is the working copy of (``--state-dir s3://...``): a record is durable
        once it is there, the background's files follow it."""

    def restored(self) -> None:
        """After a restore: the newest snapshot is the one on disk."""
        self.snapshot_round = snapshots.read_round(snapshots.snapshot_paths(self.state_dir)[-1])

    # ---- before a publish (a worker thread; raises when the write fails) ------------------------
    def bootstrap(self, snap: snapshots.Snapshot) -> None:
        snapshots.save(self.state_dir, snap, keep=None)
        if self.mirror is not None:
            self.mirror.sync()

    def log_round(self, round_: int, payloads: dict, record: dict, islands: dict, config: RunConfig) -> None:
        stream, self._stream = self._stream, None
        try:
            wal.append(self.state_dir, round_, payloads, record, islands, config, stream=stream)
        finally:
            if stream is not None:
                stream.abandon()  # finished or not: nothing of it is left behind
        if self.mirror is not None:  # durable once in the store
            self.mirror.put_record(self.state_dir / wal.LOG / wal.record_name(round_))

    @contextlib.contextmanager
    def streaming(self, round_: int, made, head_hint: int | None) -> Iterator:
        """While round ``round_``'s step runs: ``made`` that also sends each payload to the round's
        record as it is made (:class:`wal.RecordStream`); the record is finished by :meth:`log_round`,
        or abandoned if the step fails. ``head_hint`` None: ``made`` as it is (the record is written
        whole)."""
        if made is None or head_hint is None:
            yield made
            return
        if self._stream is not None:
            self._stream.abandon()
        stream = self._stream = wal.RecordStream(self.state_dir, round_, head_hint)

        def both(name: str, payload) -> None:
            stream.add(name, payload)
            made(name, payload)

        try:
            yield both
        except BaseException:
            stream.abandon()
            self._stream = None
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
            else:
                wal.write_optimizer(self.state_dir, snap.round, snap.extra)
            wal.prune(self.state_dir, snapshot_round=newest, keep_from=keep_from)
            if self.mirror is not None:
                self.mirror.sync_later()  # up in the background: the next outer step does not wait

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
        if self._stream is not None:
            self._stream.abandon()
            self._stream = None
        mirror, self.mirror = self.mirror, None
        if mirror is not None:
            mirror.close()  # (and its lease given back)

    def wait(self) -> None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None
