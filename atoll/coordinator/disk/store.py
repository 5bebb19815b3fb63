"""Where the run's state is kept: one interface, two implementations, built once
(:func:`atoll.coordinator.main.where_state_lives`) and handed to the coordinator, so nothing else
branches on which it is.

- :class:`LocalState`: a local state dir (``--state-dir DIR``); a record is durable once fsynced there.
- :class:`ObjectState`: an object store (``--state-dir s3://bucket/prefix``); the state dir is its
  working copy, the coordinator's own marked cache (:mod:`~atoll.coordinator.disk.workcopy`), kept by
  a :class:`~atoll.coordinator.disk.mirror.Mirror` under the run's lease: a record is durable once its
  PUT completed, and what the background writes follows it.

The coordinator reads and writes the state dir the same way with either (:mod:`wal`, :mod:`snapshots`).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Protocol

from atoll.coordinator.disk import workcopy
from atoll.coordinator.disk.mirror import Mirror
from atoll.coordinator.disk.upload import RecordUpload
from atoll.objects import ObjectStore


class StateStore(Protocol):
    """Where the state is kept, as the coordinator sees it (:class:`LocalState`, :class:`ObjectState`)."""

    url: str | None

    @property
    def trouble(self) -> str | None: ...

    def child(self, name: str) -> StateStore: ...

    def check(self, state_dir: Path) -> None: ...

    def open(self, state_dir: Path, run_id: str) -> None: ...

    def stream_record(self, rel: str, head_bytes: int) -> RecordUpload | None: ...

    def abandon_record(self, upload: RecordUpload) -> None: ...

    def put_record(self, path: Path, upload: RecordUpload | None = None) -> None: ...

    def put_now(self, path: Path) -> None: ...

    def sync(self) -> None: ...

    def sync_later(self) -> None: ...

    def close(self) -> None: ...

    def lease_timing(self) -> dict | None: ...


class LocalState:
    """A local state dir: the dir is the state; every step past writing it is nothing."""

    url: str | None = None
    """Where the state is, for messages (None: the state dir itself)."""

    @property
    def trouble(self) -> str | None:
        return None

    def child(self, name: str) -> LocalState:
        """The state of a fragment (its own dir under the state dir)."""
        return self

    def check(self, state_dir: Path) -> None:
        """Refuse ``state_dir`` untouched if it cannot hold this state (a local dir always can)."""

    def open(self, state_dir: Path, run_id: str) -> None:
        """Take the run (the dir's lock is the coordinator's own: :class:`~atoll.coordinator.disk.lock.StateLock`)."""

    def stream_record(self, rel: str, head_bytes: int) -> RecordUpload | None:
        """A record also going up as the step makes it: none here."""
        return None

    def abandon_record(self, upload: RecordUpload) -> None:
        pass

    def put_record(self, path: Path, upload: RecordUpload | None = None) -> None:
        """The record at ``path`` is durable: it was fsynced."""

    def put_now(self, path: Path) -> None:
        """The state file at ``path`` is durable: it was fsynced."""

    def sync(self) -> None:
        """Everything written so far is durable (θ_0's snapshot): it was fsynced."""

    def sync_later(self) -> None:
        """What the background wrote follows, in the background: nothing to follow."""

    def close(self) -> None:
        pass

    def lease_timing(self) -> dict | None:
        return None


class ObjectState:
    """The state in an object store, the state dir its working copy."""

    def __init__(
        self, store: ObjectStore, *, lease_seconds: float = 15.0, on_lost: Callable[[str], None] | None = None
    ) -> None:
        """``lease_seconds``: the run's lease in the store (a coordinator replacing a dead one waits it
        out); ``on_lost(why)``: called when this coordinator loses it."""
        self.store, self.lease_seconds, self.on_lost = store, lease_seconds, on_lost
        self.mirror: Mirror | None = None
        """The working copy's keeper, once the run is taken (:meth:`open`)."""

    @property
    def url(self) -> str:
        return self.store.url

    @property
    def trouble(self) -> str | None:
        return self.mirror.trouble if self.mirror is not None else None

    def child(self, name: str) -> ObjectState:
        return ObjectState(self.store.child(name), lease_seconds=self.lease_seconds, on_lost=self.on_lost)

    def check(self, state_dir: Path) -> None:
        """A dir that is not this store's working copy is refused untouched."""
        workcopy.check_dir(state_dir, self.store)

    def adopt(self, mirror: Mirror) -> None:
        """The run was taken already, its working copy made the store's (a standby's takeover,
        :mod:`atoll.coordinator.standby`): :meth:`open` keeps ``mirror``."""
        self.mirror = mirror

    def open(self, state_dir: Path, run_id: str) -> None:
        """Take the run's lease (one writer per run in the store) and make ``state_dir`` the store's copy."""
        if self.mirror is None:
            self.mirror = Mirror.open(
                self.store, state_dir, lease_seconds=self.lease_seconds, on_lost=self.on_lost, run_id=run_id
            )

    def stream_record(self, rel: str, head_bytes: int) -> RecordUpload | None:
        return self._mirror().stream_record(rel, head_bytes)

    def abandon_record(self, upload: RecordUpload) -> None:
        self._mirror().abandon_record(upload)

    def put_record(self, path: Path, upload: RecordUpload | None = None) -> None:
        """Durable once in the store (sent while the step ran, when ``upload`` is given)."""
        self._mirror().put_record(path, upload=upload)

    def put_now(self, path: Path) -> None:
        """That state file in the store before this returns (the rest follows in the background)."""
        self._mirror().put_now(path)

    def sync(self) -> None:
        self._mirror().sync()

    def sync_later(self) -> None:
        """Up in the background: the next outer step does not wait."""
        self._mirror().sync_later()

    def close(self) -> None:
        """Wait for what is going up, and give the lease back."""
        mirror, self.mirror = self.mirror, None
        if mirror is not None:
            mirror.close()

    def lease_timing(self) -> dict | None:
        """The run's lease, and how its renewals went (None before it is taken)."""
        lease = self.mirror.lease if self.mirror is not None else None
        return lease.timing.to_json(lease.seconds) if lease is not None else None

    def _mirror(self) -> Mirror:
        if self.mirror is None:
            raise RuntimeError("the object store's state is not open (ObjectState.open)")
        return self.mirror
