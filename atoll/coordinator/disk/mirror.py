"""A machine-local working copy of a state kept in an object store.

With ``--state-dir s3://bucket/prefix`` the coordinator reads and writes its state dir as always
(snapshots, the write-ahead log, ``head.json``: :mod:`~atoll.coordinator.disk.wal`,
:mod:`~atoll.coordinator.disk.snapshots`), in a local working dir (``--work-dir``), and the store
is what survives the machine:

- at start, after taking the run's :class:`~atoll.lease.Lease`, :meth:`Mirror.pull`
  makes the working dir, the coordinator's own marked cache, the store's copy
  (:mod:`~atoll.coordinator.disk.workcopy`), then the restore reads it and checks every file as on a
  local disk;
- a round is durable when its log record's PUT has completed (:meth:`Mirror.put_record`), before it
  is published, as the local fsync was: a create-only PUT, so no two coordinators write one round;
- what the background writes after a publish (``head.json``, the optimizer state, a snapshot) and
  what it prunes follow it on the mirror's own thread (:meth:`Mirror.sync_later`), which the next
  outer step does not wait for; a clean stop waits for it (:meth:`Mirror.close`). A coordinator
  lost before it caught up restores from the newest files that were up (the records are all there:
  θ and history exactly; momentum perhaps of an earlier round, said in a WARNING, as on a disk
  whose background write a crash cut).

S3 is strongly read-after-write consistent, so a coordinator that starts after another stopped sees
every record that one made durable.
"""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path

from atoll.coordinator.disk import snapshots, wal, workcopy
from atoll.coordinator.disk.upload import RecordUpload
from atoll.lease import Lease
from atoll.objects import Conflict, ObjectStore, StoreError

log = logging.getLogger("atoll.coordinator")


def _local_files(root: Path) -> dict[str, Path]:
    """What goes up, by relative path: the run's own files (:func:`snapshots.state_file`) and what a
    rollback set aside; not the lock, a temporary (``.name``) or anything else in the dir."""
    out = {}
    for p in root.rglob("*"):
        rel = p.relative_to(root).as_posix()
        parts = Path(rel).parts
        if not p.is_file() or any(part.startswith(".") for part in parts):
            continue
        if snapshots.state_file(rel) or snapshots.DISCARDED in parts:
            out[rel] = p
    return out


class Mirror:
    def __init__(self, store: ObjectStore, local: Path, lease: Lease | None = None, run_id: str | None = None) -> None:
        self.store, self.local, self.lease, self.run_id = store, Path(local), lease, run_id
        self._sent: dict[str, tuple[int, int]] = {}
        """(size, mtime_ns) of each local file as last uploaded (or downloaded)."""
        self._lock = threading.Lock()
        self.uploaded_bytes = 0
        self.failed: str | None = None
        """Why the last background sync failed (None: it worked); the next one retries what is missing."""
        self._cond = threading.Condition()
        self._asked = self._done = 0
        self._closing = False
        self._thread: threading.Thread | None = None
        self._committing = 0
        """Record PUTs in flight: the background's uploads wait between parts while there are any."""
        self._idle = threading.Condition()
        self.streams: bool | None = None
        """Whether records go up while the step makes them (None: unless the store is on loopback)."""

    @classmethod
    def open(
        cls, store: ObjectStore, local: Path, *, lease_seconds: float | None, on_lost=None, run_id: str | None = None
    ) -> Mirror:
        """The store's copy in ``local`` (:meth:`pull`), under the run's lease of ``lease_seconds``, taken
        first (None: no lease, to read only); :meth:`close` gives it back. A dir that is not this store's
        working copy is refused before the lease is taken (:func:`workcopy.check_dir`)."""
        workcopy.check_dir(local, store)
        lease = Lease(store, lease_seconds, on_lost=on_lost).acquire() if lease_seconds is not None else None
        mirror = cls(store, local, lease, run_id)
        try:
            mirror.pull()
        except BaseException:
            mirror.close()
            raise
        return mirror

    @classmethod
    def adopt(cls, store: ObjectStore, local: Path, lease: Lease, run_id: str | None) -> Mirror:
        """The keeper of a working copy a standby made the store's copy (it followed the store, and
        compared every file once more under ``lease``, just taken): nothing is fetched or sent again."""
        mirror = cls(store, local, lease, run_id)
        for rel, path in _local_files(mirror.local).items():
            st = path.stat()
            mirror._sent[rel] = (st.st_size, st.st_mtime_ns)
        return mirror

    def pull(self) -> int:
        """Make the working dir the store's copy of the run (:func:`~atoll.coordinator.disk.workcopy.reconcile`:
        refused when the dir is not this store's cache, nothing but the run's own files removed, each
        compared by content); returns the bytes downloaded."""
        started = time.perf_counter()
        files, got = workcopy.reconcile(self.store, self.local, self.run_id)
        for rel, path in files.items():
            st = path.stat()
            with self._lock:
                self._sent[rel] = (st.st_size, st.st_mtime_ns)
        if files:
            log.info(
                "state from %s: %d objects, %.1f MB downloaded in %.2f s",
                self.store.url,
                len(files),
                got / 1e6,
                time.perf_counter() - started,
            )
        return got

    def stream_record(self, rel: str, head_bytes: int) -> RecordUpload | None:
        """A record that goes up while the step makes it (:mod:`~atoll.coordinator.disk.upload`); the
        background's uploads wait meanwhile, as for :meth:`put_record`. Given to :meth:`put_record`, or
        to :meth:`abandon_record`. None when the store serves from this machine (a loopback endpoint):
        its work would then take the step's cores (``benchmarks/object_store.py`` at 124M: the record
        cost the round 1.68 s streamed against 1.16 s put after the step, the store on the same 2
        cores; with the store on a core of its own, 1.26 s against 1.78 s), and the record is put
        whole after the step."""
        if self.store.on_this_machine if self.streams is None else not self.streams:
            return None
        with self._idle:
            self._committing += 1
        return RecordUpload(self.store, rel, head_bytes)

    def abandon_record(self, upload: RecordUpload) -> None:
        try:
            upload.abandon()
        finally:
            self._commit_done()

    def _commit_done(self) -> None:
        with self._idle:
            self._committing -= 1
            self._idle.notify_all()

    def put_record(self, path: Path, upload: RecordUpload | None = None) -> None:
        """Round ``r``'s log record to the store, create-only: durable once this returns. ``upload``: the
        record sent while the step made it (:meth:`stream_record`), completed here; if that fails, the
        file is put whole."""
        if self.lease is not None:
            try:
                self.lease.check()
            except BaseException:
                if upload is not None:
                    self.abandon_record(upload)
                raise
        rel = Path(path).relative_to(self.local).as_posix()
        if upload is None:
            with self._idle:
                self._committing += 1
        try:
            self._commit(Path(path), rel, upload)
        except Conflict:
            got = self.store.get(rel)
            if got is not None and got[0] == Path(path).read_bytes():
                return self._sent_now(path, rel)  # our own PUT, retried after its answer was lost
            why = f"{self.store.url}/{rel} exists already: another coordinator wrote this round"
            if self.lease is not None:
                self.lease.lose(why)  # it stops: retrying the save could never succeed
            raise StoreError(f"{why} (this one lost the run)") from None
        finally:
            self._commit_done()
        self._sent_now(path, rel)
        if self.lease is not None:
            self.lease.check()  # a PUT that outlasted the lease (a stalled store) publishes nothing

    def put_now(self, path: Path) -> None:
        """One state file (not a record) to the store now, under the lease, on the caller's thread: the
        optimizer state ``--exact-failover`` puts up before a publish. It waits for nothing else (a
        snapshot the background is sending waits for it, as for a record)."""
        if self.lease is not None:
            self.lease.check()
        rel = Path(path).relative_to(self.local).as_posix()
        with self._idle:
            self._committing += 1  # (the background's uploads wait, as for a record)
        try:
            self.store.put_file(Path(path), rel)
        finally:
            self._commit_done()
        self._sent_now(path, rel)

    def _commit(self, path: Path, rel: str, upload: RecordUpload | None) -> None:
        """The record's create-only write: the streamed upload completed, or else the file put whole."""
        if upload is not None:
            try:
                with open(path, "rb") as f:
                    head = f.read(upload.head_bytes)
                upload.finish(head, path.stat().st_size)
                return
            except Conflict:
                raise
            except (StoreError, OSError) as err:
                log.info("%s: the record sent during the step did not go up (%s); putting it whole", rel, err)
        self.store.put_file(path, rel, create_only=True)

    def _sent_now(self, path: Path, rel: str) -> None:
        st = Path(path).stat()
        with self._lock:
            self._sent[rel] = (st.st_size, st.st_mtime_ns)
            self.uploaded_bytes += st.st_size

    def sync(self) -> None:
        """Upload the local state files that are new or changed (not log records: see put_record), then
        delete the objects whose local file is gone (pruned): a record goes only after the snapshot
        that replaces it is up. A file pruned while this runs is skipped."""
        if self.lease is not None:
            self.lease.check()
        local = _local_files(self.local)
        for rel, path in sorted(local.items()):
            if wal.is_record(rel):  # records go up on the critical path (put_record), never with a sync
                continue
            try:
                st = path.stat()
                with self._lock:
                    sent = self._sent.get(rel)
                if sent != (st.st_size, st.st_mtime_ns):
                    self.store.put_file(path, rel, yield_to=self._after_commits)
            except FileNotFoundError:  # pruned meanwhile
                continue
            with self._lock:
                if sent != (st.st_size, st.st_mtime_ns):
                    self._sent[rel] = (st.st_size, st.st_mtime_ns)
                    self.uploaded_bytes += st.st_size
        with self._lock:
            gone = [r for r in self._sent if not (self.local / r).exists()]  # (a record put meanwhile is there)
        for rel in gone:
            self.store.delete(rel)
            with self._lock:
                self._sent.pop(rel, None)

    def _after_commits(self) -> None:
        """Wait while a record is going up: the store's bandwidth is the commit's first."""
        with self._idle:
            while self._committing:
                self._idle.wait()

    # ---- in the background ------------------------------------------------------------------------
    def sync_later(self) -> None:
        """:meth:`sync` on the mirror's own thread: what the background writer wrote goes up while the
        run goes on (the next outer step does not wait for it: the optimizer state alone is 2|θ| a
        round). A sync asked while one runs is one more after it; superseded files (an optimizer file
        a newer one replaced, pruned meanwhile) never go up."""
        with self._cond:
            self._asked += 1
            if self._thread is None:
                self._thread = threading.Thread(target=self._uploads, name="atoll-uploads", daemon=True)
                self._thread.start()
            self._cond.notify_all()

    def flush(self) -> None:
        """Wait until every sync asked so far is done."""
        with self._cond:
            target = self._asked
            while self._done < target and self._thread is not None:
                self._cond.wait(0.5)

    @property
    def trouble(self) -> str | None:
        """What is wrong with the store, for /healthz: the lease lost, or not renewed on time, or the
        background's uploads failing; None when all is well."""
        lease = self.lease
        if lease is not None and (lease.lost or lease.trouble):
            return f"{self.store.url}: " + (f"the lease is lost ({lease.lost})" if lease.lost else lease.trouble)
        return None if self.failed is None else f"uploading the state to {self.store.url} fails ({self.failed})"

    def close(self) -> None:
        """Flush and stop the background thread (a clean stop leaves the store complete), then give the
        lease back. A coordinator that lost the lease writes nothing more: it does not wait for uploads
        (a stalled store would hold its exit)."""
        if self.lease is not None and self.lease.lost is not None:
            with self._cond:
                self._closing = True
                self._cond.notify_all()
            self.lease.release()
            self.lease = None
            return
        self.flush()
        with self._cond:
            self._closing = True
            self._cond.notify_all()
            thread, self._thread = self._thread, None
        if thread is not None:
            thread.join()
        lease, self.lease = self.lease, None
        if lease is not None:
            lease.release()

    def _uploads(self) -> None:
        while True:
            with self._cond:
                while self._asked == self._done and not self._closing:
                    self._cond.wait()
                if self._asked == self._done:
                    return
                target = self._asked
            try:
                self.sync()
                self.failed = None
            except Exception as err:  # retried by the next sync; the records (the commits) went up already
                self.failed = str(err)
                log.error("uploading the state to %s failed: %s (retried after the next round)", self.store.url, err)
            with self._cond:
                self._done = target
                self._cond.notify_all()
