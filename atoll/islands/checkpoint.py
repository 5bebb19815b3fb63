"""Island checkpoints: model, inner optimizer, DiLoCo state, RNG, and the loop's own state (data
position, LR schedule), for an island to resume exactly.

    ckpt = IslandCheckpoint("/ckpt/site-a", model, opt, state=lambda: {"data": sampler.state_dict()},
                            load_state=lambda s: sampler.load_state_dict(s["data"]))
    sync = DiLoCo(model, link, before_push=ckpt.save)
    ckpt.load(sync)              # before start(): the newest complete checkpoint, if there is one
    with sync:
        ...                      # the loop; on SIGTERM (Preempted): ckpt.save(sync)() before leaving

Saved at each push (``DiLoCo(before_push=...)``), written in the background (the push waits for the write,
so every push the coordinator counts has a checkpoint), and loaded at start, so a
killed island restarted with the same arguments resumes where it was: it re-pushes the round it
had pushed (the coordinator answers "duplicate" if it has it) and continues with exactly the
optimizer moments, data position and random state of the uninterrupted run.

``DIR`` is a local dir or ``s3://bucket/prefix`` (:mod:`atoll.islands._ckpt_store`).
``DIR/step-<inner steps>/`` holds a torch.distributed.checkpoint of the model and optimizer (as the
island shards them: FSDP2 and TP DTensors via ``get_state_dict``), and per rank ``rank-<r>.pt``
(torch.save of the rest) and a ``done-<r>`` marker written last. A checkpoint counts only once every
rank's marker is there: a crash mid-save leaves the previous one in charge. DCP writes from a
background thread on a process group of its own (gloo), so its collectives never interleave with
the training thread's.
"""

from __future__ import annotations

import logging
import pickle
import shutil
import threading
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from atoll.files import write_atomic
from atoll.islands._ckpt_store import CheckpointStore
from atoll.islands._safe_dcp import SafePlanner, SafeReader, UnsafeCheckpoint, verify
from atoll.objects import ObjectStore, is_url

log = logging.getLogger("atoll.island")

PREFIX = "step-"
SINGLE_PROCESS = "torch.distributed is disabled, unavailable or uninitialized, assuming the intent is to"


class IslandCheckpointer:
    def __init__(
        self, directory: str | Path, *, rank: int = 0, world: int = 1, keep: int = 2, work_dir: Path | None = None
    ) -> None:
        """``directory``: a local dir, or ``s3://bucket/prefix`` in an object store
        (:mod:`atoll.islands._ckpt_store`), written through a working dir on this machine (``work_dir``,
        default under the temp dir; one per rank)."""
        self.remote: CheckpointStore | None = None
        if is_url(directory):
            store = ObjectStore.from_url(str(directory))
            base = work_dir or store.default_work_dir("checkpoints")
            self.remote = CheckpointStore(store, rank, world, PREFIX)
            directory = Path(base) / f"rank-{rank}"
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.rank, self.world, self.keep = rank, world, keep
        self.group = dist.new_group(backend="gloo") if world > 1 else None
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self.saves = 0
        self.save_seconds = 0.0
        """Time the training thread spent starting saves (staging to CPU)."""

    # ---- saving ---------------------------------------------------------------------------------
    def save(self, step: int, model: torch.nn.Module, optimizer, extra: dict) -> None:
        """Stage the state on the CPU now and write it in the background (the previous save must be
        done; a save that failed raises here)."""
        started = time.perf_counter()
        self.wait()
        path = self.dir / f"{PREFIX}{step:010d}"
        model_sd, optim_sd = get_state_dict(model, optimizer)
        self._quiet()
        future = dcp.async_save(
            {"model": model_sd, "optim": optim_sd},
            checkpoint_id=str(path),
            process_group=self.group,
            no_dist=self.world == 1,  # one rank: say so, or torch warns at every save that it assumes it
        )
        self._thread = threading.Thread(target=self._finish, args=(future, path, extra), name="atoll-ckpt", daemon=True)
        self._thread.start()
        self.saves += 1
        self.save_seconds += time.perf_counter() - started

    def _finish(self, future, path: Path, extra: dict) -> None:
        try:
            future.result()
            import io

            buf = io.BytesIO()
            torch.save(extra, buf)
            write_atomic(path / f"rank-{self.rank}.pt", [buf.getbuffer()])
            write_atomic(path / f"done-{self.rank}", [b"ok\n"])
            if self.remote is not None:
                self.remote.upload(path)
            if self.rank == 0:
                self._prune()
        except BaseException as err:  # raised by the next save or wait()
            self._error = err

    def wait(self) -> None:
        """Block until the save in progress is written."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            err, self._error = self._error, None
            raise RuntimeError(f"writing the island checkpoint failed: {err}") from err

    def _complete(self) -> list[Path]:
        """Complete checkpoints, oldest first."""
        out = []
        for p in sorted(self.dir.glob(f"{PREFIX}*")):
            if p.is_dir() and (p / ".metadata").exists() and all((p / f"done-{r}").exists() for r in range(self.world)):
                out.append(p)
        return out

    def _prune(self) -> None:
        complete = self._complete()
        if not complete:
            return
        newest = complete[-1]
        keep = set(complete[-self.keep :])
        for p in self.dir.glob(f"{PREFIX}*"):
            if p not in keep and p.name < newest.name:
                shutil.rmtree(p, ignore_errors=True)
        if self.remote is not None:
            self.remote.prune({p.name for p in keep} | set(self.remote.complete()[-self.keep :]))

    def _quiet(self) -> None:
        """One rank: DCP warns at every save and load that it assumes a single process, even when told
        so (no_dist=True), from its own writer thread; that one message is filtered (it is what we ask)."""
        if self.world == 1:
            warnings.filterwarnings("ignore", message=SINGLE_PROCESS, category=UserWarning)

    # ---- loading --------------------------------------------------------------------------------
    def shown(self, path: Path) -> str:
        """Where a checkpoint is, as the operator named it (the store's URL, not the working copy)."""
        return f"{self.remote.store.url}/{path.name}" if self.remote is not None else str(path)

    def latest(self) -> Path | None:
        """The newest complete checkpoint (rank 0 decides; every rank loads the same)."""
        if self.remote is not None:  # the store's newest, fetched to this rank's working dir
            complete = self.remote.complete() if self.rank == 0 else []
            choice = [complete[-1] if complete else ""]
            if self.world > 1:
                dist.broadcast_object_list(choice, src=0, group=self.group)
            return self.remote.fetch(choice[0], self.dir) if choice[0] else None
        complete = self._complete()
        choice = [str(complete[-1]) if complete else ""]
        if self.world > 1:
            dist.broadcast_object_list(choice, src=0, group=self.group)
        return Path(choice[0]) if choice[0] else None

    def load(self, model: torch.nn.Module, optimizer) -> dict | None:
        """Load the newest complete checkpoint into ``model`` and ``optimizer``; returns this rank's
        extra state, or None when there is none."""
        path = self.latest()
        if path is None:
            return None
        model_sd, optim_sd = get_state_dict(model, optimizer)
        state = {"model": model_sd, "optim": optim_sd}
        self._quiet()
        try:  # no code from the checkpoint runs: allowlisted metadata, plain values (atoll.islands._safe_dcp)
            verify(path)
            dcp.load(
                state,
                storage_reader=SafeReader(str(path)),
                planner=SafePlanner(),
                process_group=self.group,
                no_dist=self.world == 1,
            )
        except UnsafeCheckpoint as err:
            raise UnsafeCheckpoint(f"the island checkpoint {self.shown(path)} is refused: {err}") from None
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
        try:
            extra = torch.load(path / f"rank-{self.rank}.pt", weights_only=True)
        except pickle.UnpicklingError as err:
            raise UnsafeCheckpoint(
                f"the island checkpoint {self.shown(path)} is refused: rank-{self.rank}.pt is not tensors and plain "
                f"values ({str(err).splitlines()[0]})"
            ) from None
        log.info("loaded the island checkpoint %s", path)
        return extra


RNG = ("torch_rng", "cuda_rng")


class IslandCheckpoint:
    """What an island needs to resume exactly, through torch.distributed.checkpoint (sharded as the
    island is: FSDP2 and TP DTensors included): the model, the inner optimizer, :class:`DiLoCo`'s state,
    torch's RNG (CPU and CUDA) and ``state()``, the loop's own (data position, LR scheduler, generators;
    tensors and plain Python values).

    ``save(sync)`` is made for ``DiLoCo(before_push=...)``: it stages everything now, writes it in the
    background and returns the wait for the write, which the push waits for (a push the coordinator
    counts always has a checkpoint behind it). ``load(sync)``, before ``sync.start()``, restores the
    newest complete checkpoint and returns True, or False when there is none. Collective over the
    island's ranks (each writes its shards and its own DiLoCo state)."""

    def __init__(
        self,
        directory: str | Path,
        model: torch.nn.Module,
        optimizer,
        *,
        state=None,
        load_state=None,
        keep: int = 2,
        work_dir: Path | None = None,
    ) -> None:
        """``directory``: a local dir, or ``s3://bucket/prefix`` (``pip install 'atoll[s3]'``; written
        through ``work_dir`` on this machine, default under the temp dir)."""
        distributed = dist.is_available() and dist.is_initialized()
        rank, world = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)
        self.writer = IslandCheckpointer(directory, rank=rank, world=world, keep=keep, work_dir=work_dir)
        self.model, self.optimizer = model, optimizer
        self.state, self.load_state = state, load_state
        self.seconds = 0.0
        """Time the last save took on the calling thread (staging; the write is in the background)."""

    def save(self, sync):
        """Stage the checkpoint now and write it in the background; returns the wait for the write."""
        started = time.perf_counter()
        extra = {
            "diloco": sync.state_dict(),
            "torch_rng": torch.get_rng_state(),
            "cuda_rng": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
            "user": self.state() if self.state is not None else {},
        }
        self.writer.save(sync.inner_steps, self.model, self.optimizer, extra)
        self.seconds = time.perf_counter() - started
        return self.writer.wait

    def load(self, sync) -> bool:
        """Restore the newest complete checkpoint into the model, the optimizer, ``sync`` (not started)
        and the RNG, and hand the loop's own state to ``load_state``; False when there is none."""
        extra = self.writer.load(self.model, self.optimizer)
        if extra is None:
            return False
        sync.load_state_dict(extra["diloco"])
        torch.set_rng_state(extra["torch_rng"])
        if extra["cuda_rng"]:
            torch.cuda.set_rng_state_all(extra["cuda_rng"])
        if self.load_state is not None:
            self.load_state(extra["user"])
        return True

    def wait(self) -> None:
        """Block until the write in progress is done (before the process exits)."""
        self.writer.wait()
