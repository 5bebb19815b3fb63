"""A machine-local working copy of a state kept in an object store.

With ``--state-dir s3://bucket/prefix`` the coordinator reads and writes its state dir as always
(snapshots, the write-ahead log, ``head.json``: :mod:`~atoll.coordinator.disk.wal`,
:mod:`~atoll.coordinator.disk.snapshots`), in a local working dir (``--work-dir``), and the store
is what survives the machine:

- at start, after taking the run's :class:`~atoll.objects.Lease`, :meth:`Mirror.pull`
  makes the working dir the store's copy (what is missing or differs is downloaded; what the store
  does not hold is removed), then the restore reads it and checks every file as on a local disk;
- a round is durable when its log record's PUT has completed (:meth:`Mirror.put_record`), before it
  is published, as the local fsync was: a create-only PUT, so no two coordinators write one round;
- what the background writes after a publish (``head.json``, the optimizer state, a snapshot) and
  what it prunes follow it in the same background thread (:meth:`Mirror.sync`).

S3 is strongly read-after-write consistent, so a coordinator that starts after another stopped sees
every record that one made durable.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

from atoll.objects import LEASE, Conflict, Lease, ObjectStore, StoreError

log = logging.getLogger("atoll.coordinator")

RECORDS = "log/round-"
"""Log records go up on the critical path (:meth:`Mirror.put_record`), never with a sync."""


def _local_files(root: Path) -> dict[str, Path]:
    """State files under ``root`` by relative path: not the lock, not a temporary (``.name``)."""
    out = {}
    for p in root.rglob("*"):
        rel = p.relative_to(root).as_posix()
        if p.is_file() and not any(part.startswith(".") for part in Path(rel).parts):
            out[rel] = p
    return out


class Mirror:
    def __init__(self, store: ObjectStore, local: Path, lease: Lease | None = None) -> None:
        self.store, self.local, self.lease = store, Path(local), lease
        self._sent: dict[str, tuple[int, int]] = {}
        """(size, mtime_ns) of each local file as last uploaded (or downloaded)."""
        self.uploaded_bytes = 0

    def pull(self) -> int:
        """Make the working dir the store's copy; returns the bytes downloaded."""
        started, got = time.perf_counter(), 0
        remote = {rel: size for rel, size in self.store.listing().items() if Path(rel).name != LEASE}
        self.local.mkdir(parents=True, exist_ok=True)
        local = _local_files(self.local)
        for rel, path in local.items():
            if rel not in remote:
                path.unlink()  # not the run's (a stale working dir): the store is the truth
        for rel, size in sorted(remote.items()):
            path = self.local / rel
            if rel not in local or path.stat().st_size != size:
                self.store.download(rel, path)
                got += size
            st = path.stat()
            self._sent[rel] = (st.st_size, st.st_mtime_ns)
        if remote:
            log.info(
                "state from %s: %d objects, %.1f MB downloaded in %.2f s",
                self.store.url,
                len(remote),
                got / 1e6,
                time.perf_counter() - started,
            )
        return got

    def put_record(self, path: Path) -> None:
        """Round ``r``'s log record to the store, create-only: durable once this returns."""
        if self.lease is not None:
            self.lease.check()
        rel = Path(path).relative_to(self.local).as_posix()
        try:
            self.store.put_file(path, rel, create_only=True)
        except Conflict:
            raise StoreError(
                f"{self.store.url}/{rel} exists already: another coordinator wrote this round (this one lost the run)"
            ) from None
        st = Path(path).stat()
        self._sent[rel] = (st.st_size, st.st_mtime_ns)
        self.uploaded_bytes += st.st_size

    def sync(self) -> None:
        """Upload the local state files that are new or changed (not log records: see put_record) and
        delete the objects whose local file is gone (pruned)."""
        if self.lease is not None:
            self.lease.check()
        local = _local_files(self.local)
        for rel, path in sorted(local.items()):
            if rel.startswith(RECORDS):
                continue
            st = path.stat()
            if self._sent.get(rel) != (st.st_size, st.st_mtime_ns):
                self.store.put_file(path, rel)
                self._sent[rel] = (st.st_size, st.st_mtime_ns)
                self.uploaded_bytes += st.st_size
        for rel in [r for r in self._sent if r not in local]:
            self.store.delete(rel)
            del self._sent[rel]
