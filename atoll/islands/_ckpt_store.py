"""Island checkpoints in an S3-compatible object store (``--checkpoint-dir s3://bucket/prefix``).

Each rank writes its checkpoint to a machine-local working dir exactly as to a local one (the
torch.distributed.checkpoint files, ``rank-<r>.pt``, the ``done-<r>`` marker), then puts its own
files in the store (:meth:`CheckpointStore.upload`): its DCP shards (``__<r>_*.distcp``), its
``rank-<r>.pt``, rank 0 the DCP ``.metadata``, and its ``done-<r>`` marker last. A checkpoint counts
once every rank's marker is in the store, so one cut mid-upload leaves the previous one in charge, as
on disk. At start the newest complete one is downloaded whole (any rank may read any shard: DCP
reshards on load) into each rank's working dir and loaded from there.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path

from atoll.objects import ObjectStore

log = logging.getLogger("atoll.island")

MARKER = re.compile(r"done-(\d+)")


class CheckpointStore:
    def __init__(self, store: ObjectStore, rank: int, world: int, prefix: str) -> None:
        """``prefix``: the checkpoints' directory names start with it (``step-``)."""
        self.store, self.rank, self.world, self.prefix = store, rank, world, prefix

    def mine(self, name: str) -> bool:
        """Whether this rank puts a checkpoint file of that name in the store (its marker aside)."""
        if name == ".metadata":
            return self.rank == 0
        return name == f"rank-{self.rank}.pt" or name.startswith(f"__{self.rank}_")

    def upload(self, path: Path) -> None:
        """This rank's files of the local checkpoint ``path``, then its marker."""
        for f in sorted(path.iterdir()):
            if f.is_file() and self.mine(f.name):
                self.store.put_file(f, f"{path.name}/{f.name}")
        marker = path / f"done-{self.rank}"
        self.store.put_file(marker, f"{path.name}/{marker.name}")

    def complete(self) -> list[str]:
        """Names of the checkpoints every rank finished, oldest first."""
        files: dict[str, set[str]] = {}
        for rel in self.store.listing():
            step, _, name = rel.partition("/")
            if step.startswith(self.prefix) and name:
                files.setdefault(step, set()).add(name)
        done = {f"done-{r}" for r in range(self.world)} | {".metadata"}
        return sorted(step for step, names in files.items() if done <= names)

    def fetch(self, step: str, local: Path) -> Path:
        """The checkpoint ``step`` into ``local/step`` (what is there already with its size is kept)."""
        target = local / step
        for rel, size in self.store.listing().items():
            if rel.startswith(step + "/"):
                path = local / rel
                if not (path.exists() and path.stat().st_size == size):
                    self.store.download(rel, path)
        log.info("fetched the island checkpoint %s/%s", self.store.url, step)
        return target

    def prune(self, keep: set[str]) -> None:
        """Delete the checkpoints older than the newest complete one that ``keep`` does not name."""
        complete = self.complete()
        if not complete:
            return
        newest = complete[-1]
        for rel in self.store.listing():
            step = rel.partition("/")[0]
            if step.startswith(self.prefix) and step not in keep and step < newest:
                self.store.delete(rel)
