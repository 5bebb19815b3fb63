"""A standby's copy of a run kept in an object store: the working dir in step with the store, and
the run's state in memory, advanced record by record as the records land.

``atoll coordinator --standby`` (:mod:`atoll.coordinator.standby`) follows the run with a
:class:`Follower` while another coordinator holds its lease; when the lease lapses it takes it and
serves from :attr:`Follower.snap`, θ of the newest round the store holds, without reading the state
again. Every file it holds is verified as a restore verifies it: a snapshot whole
(:func:`~atoll.coordinator.disk.snapshots.load`), each record's checksums before its update is added
to θ (:func:`~atoll.coordinator.disk.wal.apply`, the restore's and the islands' very arithmetic), the
optimizer file's. Nothing is written to the store: the follower holds no lease.

What the follower cannot have exactly: the outer optimizer's state of the newest round when its
holder died between the round's publish and that file's upload (it goes up just after each publish,
in the background); the state then carries the previous round's momentum, said in a WARNING, as a
restart after a crash does (:func:`~atoll.coordinator.disk.wal.replay`).
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import torch

from atoll.coordinator.disk import snapshots, wal, workcopy
from atoll.coordinator.disk.lock import StateLock
from atoll.errors import BadInput
from atoll.objects import LEASE, Missing, ObjectStore

log = logging.getLogger("atoll.coordinator")


class NoRun(BadInput):
    """What a standby is pointed at holds no run it can follow (one line; the command exits 2)."""


class Follower:
    def __init__(self, store: ObjectStore, local: Path, run_id: str | None = None) -> None:
        """``local``: the standby's working dir (its own, marked as the store's copy); ``run_id``: the
        run it was told to follow (None: whichever the store holds)."""
        self.store, self.local, self.run_id = store, Path(local), run_id
        self.snap: snapshots.Snapshot | None = None
        """The run's state in memory: θ and history of the newest round followed, verified."""
        self.optimizer_round = -1
        """The round of :attr:`snap`'s optimizer state (below ``snap.round``: an older round's)."""
        self.rounds_followed = 0
        self._have: dict[str, int] = {}
        """Size of each state file in the working dir as fetched."""
        self._lock: StateLock | None = None

    # ---- the start --------------------------------------------------------------------------------
    def start(self) -> None:
        """Take the working dir (one process per dir), make it the store's copy, and load the run.
        NoRun when the store holds no run and nobody holds its lease (a URL with no run), or holds
        another run than ``run_id``. A run whose holder has not written θ_0 yet is waited for."""
        workcopy.check_dir(self.local, self.store)
        self._lock = StateLock(self.local).acquire("following a run in it")
        try:
            while True:
                listed = self.store.listing()
                if any(snapshots.state_file(rel) for rel in listed):
                    break
                if LEASE not in listed:
                    raise NoRun(
                        f"{self.store.url} holds no run and no coordinator holds it: a standby follows a run "
                        "another coordinator serves (start that one first, or check the URL)"
                    )
                time.sleep(0.5)  # its holder is bootstrapping: θ_0 is not up yet
            files, got = workcopy.reconcile(self.store, self.local, self.run_id)
            self._have = {rel: path.stat().st_size for rel, path in files.items()}
            self._load()
            log.info(
                "following run %s in %s at round %d (%.1f MB fetched)",
                self.snap.config.run_id,
                self.store.url,
                self.snap.round,
                got / 1e6,
            )
        except BaseException:
            self.release()
            raise

    def release(self) -> None:
        """Let go of the working dir (the coordinator that takes over takes it again at once)."""
        if self._lock is not None:
            self._lock.release()
            self._lock = None

    # ---- following ----------------------------------------------------------------------------------
    def catch_up(self) -> int:
        """Fetch what landed in the store since the last call, drop what it pruned, and advance the
        state by each new record (a gap, where records the state needs were pruned meanwhile, reloads
        it from the newest snapshot); returns the rounds it advanced."""
        listed = self.store.listing()
        remote = {rel: size for rel, size in listed.items() if snapshots.state_file(rel)}
        for rel in [r for r in self._have if r not in remote]:
            (self.local / rel).unlink(missing_ok=True)  # pruned in the store (the store is the truth)
            del self._have[rel]
        fetched = False
        for rel, size in sorted(remote.items()):
            if self._have.get(rel) == size:
                continue  # (a small JSON file rewritten at its size is compared whole at the takeover: final)
            try:
                self.store.download(rel, self.local / rel)
            except Missing:
                continue  # pruned between the listing and the fetch
            self._have[rel] = size
            fetched = True
        if not fetched:
            return 0
        before = self.snap.round if self.snap is not None else 0
        self._advance()
        done = self.snap.round - before
        self.rounds_followed += max(done, 0)
        return done

    def final(self) -> list[str]:
        """The last catch-up, under the lease just taken (nothing lands any more): every file compared
        with the store's (:func:`workcopy.reconcile`), the state advanced to the store's newest round,
        the departures read; returns what the operator should know (an optimizer state of an older
        round)."""
        files, _ = workcopy.reconcile(self.store, self.local, self.snap.config.run_id if self.snap else self.run_id)
        self._have = {rel: path.stat().st_size for rel, path in files.items()}
        self._advance()
        departed = snapshots.read_departed(self.local)
        if departed is not None:
            self.snap.departed = departed
        head = snapshots.read_head(self.local)
        if head is not None and self.snap.round < head:
            raise snapshots.StateError(
                f"{self.store.url} published round {head}, but its snapshot and log reach only round {self.snap.round}"
            )
        if self.optimizer_round < self.snap.round:
            return [
                f"the outer optimizer state of round {self.snap.round} was not in the store (it goes up just "
                f"after a publish, and its holder died first); continuing with round {self.optimizer_round}'s momentum"
            ]
        return []

    # ---- the state in memory --------------------------------------------------------------------
    def _load(self) -> None:
        """The state from the working dir: the newest snapshot, verified, with the log after it."""
        snap = snapshots.load(self.local, where=self.store.url)
        if snap is None:
            raise NoRun(f"{self.store.url} holds no snapshot of a run")
        if self.run_id is not None and snap.config.run_id != self.run_id:
            raise NoRun(
                f"{self.store.url} holds run {snap.config.run_id!r}, not {self.run_id!r}: a standby follows "
                "the run it is given (check --run-id and the URL)"
            )
        kept = [r for r, _ in wal.optimizer_files(self.local) if r <= snap.round]
        newest_snapshot = max(snapshots.read_round(p) for p in snapshots.snapshot_paths(self.local))
        self.snap, self.optimizer_round = snap, max([newest_snapshot, *kept])

    def _advance(self) -> None:
        snap = self.snap
        if snap is None:
            return self._load()
        for round_, path in wal.records(self.local):
            if round_ < snap.round:
                continue
            if round_ != snap.round:  # records this state needs were pruned: a snapshot covers them
                log.info("following %s: round %d is past the log this state reaches; reloading", self.store.url, round_)
                return self._load()
            wal.apply(snap, path)
        # The optimizer state of the newest round it reaches: an optimizer file, or a snapshot (every
        # ``--snapshot-every`` rounds one stands in for the file), each verified whole.
        opts = [(r, p, False) for r, p in wal.optimizer_files(self.local)]
        opts += [(snapshots.read_round(p), p, True) for p in snapshots.snapshot_paths(self.local)]
        newest = max((o for o in opts if o[0] <= snap.round), default=None, key=lambda o: o[0])
        if newest is None or newest[0] <= self.optimizer_round:
            return None
        round_, path, whole = newest
        if whole:
            saved = snapshots.verify(path)
            if round_ == snap.round and any(not torch.equal(saved.params[k], snap.params[k]) for k in snap.params):
                raise snapshots.StateError(f"{path.name} holds another θ than its round's records make")
            snap.extra = {k: saved.extra[k] for k in snap.extra} if set(saved.extra) == set(snap.extra) else saved.extra
        else:
            snap.extra = wal.read_optimizer(path, snap.extra)
        self.optimizer_round = round_
        return None
