"""DiLoCo's options: the algorithm's settings, written once (defaults, documentation, checks).

``DiLoCo(model, link, **options)`` takes exactly these fields as keyword arguments; how to reach the
coordinator is the link's business (:class:`~atoll.islands.CoordinatorLink`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from typing_extensions import TypedDict  # typing's own takes Unpack (PEP 692) from Python 3.11 on

from atoll.compression import get_codec
from atoll.islands._shard_state import Placement


@dataclass(frozen=True, kw_only=True)
class DiLoCoOptions:
    sync_every: int | None = None
    """H, inner steps per round, for this island; None takes the run's (a different value is warned
    about, naming both)."""
    codec: str | None = None
    """A codec name insists on the run's codec being that one; a spec with parameters
    (``"int8:block=64"``) must match the run's exactly (the coordinator refuses it at Join)."""
    sync_every_seconds: float | None = None
    """Sync on this time budget instead of every H steps (a slow island does fewer inner steps; its
    delta is weighted by the tokens it reports)."""
    overlap_steps: int = 0
    """τ > 0: push and pull in the background and keep training; the outer update is applied τ inner
    steps after the push (waiting only if it has not arrived by then), keeping the progress made
    meanwhile: θ ← θ_global + (θ_now − θ_at_push). 0 is plain DiLoCo, exactly."""
    align_pushes: bool = True
    """Decoupled runs: move this island's pushes by where its last ones landed in their rounds (the
    coordinator says, with each update), so the islands' pushes come together and none trains long on
    a θ its round is about to replace; a push then covers between H/2 and 2H inner steps. False: every
    H steps, as in sync runs."""
    update_wait: float = 0.2
    """Decoupled runs: after a push, wait for its update up to this many times the compute time the
    push's steps took, and apply it if it came, so that no step is taken on the θ it replaces; else
    train on without it. Only while the island's last exchange came back within 1.5 times that: islands of
    equal speed, whose rounds close soon after their pushes, wait a moment; a fast island whose rounds
    wait for slower ones trains on. The wait counts as blocked time. 0: never wait."""
    streaming: bool = False
    """The coordinator's shards are Streaming DiLoCo fragments (``atoll coordinator --fragments P``):
    fragment p first syncs after ⌈(p+1)·H/P⌉ steps, then every H, so each sync moves about 1/P of the model."""
    outer_state: str = "host"
    """Where round-start θ, error-feedback residuals and overlap snapshots live: ``"host"`` (pinned
    memory on CUDA: the accelerator holds no extra model copy) or ``"device"``."""
    staged_copies: bool | None = None
    """Payloads cross between the device and the host in one copy each way, on a side stream, through
    pinned buffers and a device mirror kept per shard (:mod:`atoll.compression.staging`; GPU memory:
    one encoded payload per shard). None: on a CUDA device; False: per-piece copies as on the CPU;
    True: also on the CPU (mirror in host memory: the same bytes, for tests)."""
    sync_buffers: bool = True
    """Average floating-point buffers (BatchNorm statistics) over the islands too; every island of a
    run must choose the same."""
    process_group: object = field(default=None, compare=False)
    """The island's ranks (default: the whole torch.distributed world, when it is initialised)."""
    token_group: object = field(default=None, compare=False)
    """The ranks whose ``tokens`` add up to the island's (default: ``process_group``; under tensor
    parallelism pass the data-parallel group, whose ranks see different data)."""
    before_push: Callable | None = field(default=None, compare=False)
    """``before_push(sync)``: called on the training thread once a round's pseudo-gradients are encoded
    and before they are sent: the moment to checkpoint the island (its ``state_dict()`` then holds the
    payloads, so a resumed island re-pushes them and does not redo the round). If it returns a
    callable (the wait for a checkpoint written in the background), the push waits for it: a push
    the coordinator counts then always has a durable checkpoint behind it, so an island killed at any
    moment resumes exactly."""

    model_card: dict | None = field(default=None, compare=False)
    """What the model is, JSON-able (its class and config, a tokenizer's symbols): the run keeps the first
    island's and ``atoll export`` writes it beside the weights. None: a Hugging Face model's config
    (``model.config``), else nothing. At most 64 KiB as JSON."""
    handle_sigterm: bool = True
    """From ``start()`` to ``close()``, SIGTERM (Slurm preemption, Kubernetes pod deletion) makes
    ``step()`` raise :class:`~atoll.islands.errors.Preempted` at the end of the inner step, or abandon
    the outer step it waits for: leaving the ``with`` block then leaves the run. Only in the main thread,
    and only where no other SIGTERM handler is set."""

    def __post_init__(self) -> None:
        if self.codec is not None:
            get_codec(self.codec)  # ValueError with the reason for a bad spec
        if self.sync_every is not None and self.sync_every < 1:
            raise ValueError(f"sync_every must be >= 1, got {self.sync_every}")
        if self.sync_every_seconds is not None and not self.sync_every_seconds > 0:
            raise ValueError(f"sync_every_seconds must be > 0, got {self.sync_every_seconds}")
        if self.overlap_steps < 0:
            raise ValueError(f"overlap_steps must be >= 0, got {self.overlap_steps}")
        if not 0 <= self.update_wait <= 10:  # (not a NaN either)
            raise ValueError(
                f"update_wait must be between 0 and 10 (times a push's compute time), got {self.update_wait}"
            )
        if self.streaming and self.sync_every_seconds is not None:
            raise ValueError("streaming staggers fragments by inner steps; it cannot sync on a time budget")
        Placement(self.outer_state, torch.device("cpu"))  # ValueError for an unknown placement


class DiLoCoKwargs(TypedDict, total=False):
    """:class:`DiLoCoOptions`' fields as ``DiLoCo``'s keyword arguments, for type checkers
    (``**options: Unpack[DiLoCoKwargs]``). Their defaults and documentation are the dataclass's; a test
    holds the two to the same names and types."""

    sync_every: int | None
    codec: str | None
    sync_every_seconds: float | None
    overlap_steps: int
    align_pushes: bool
    update_wait: float
    streaming: bool
    outer_state: str
    staged_copies: bool | None
    sync_buffers: bool
    process_group: object
    token_group: object
    before_push: Callable | None
    model_card: dict | None
    handle_sigterm: bool
