"""Process-wide allocator settings for moving large tensor payloads.

Both ends of a push handle a stream of ~1 MiB buffers: gRPC's receive slices, the Python
``bytes`` of each chunk, a payload's staging buffer. glibc's defaults serve each of them with a
fresh ``mmap`` (or hand freed heap memory straight back to the kernel), so every buffer is
page-faulted and zeroed by the kernel again. Measured on this 2-core machine
(``benchmarks/load.py``), that page churn was the largest single cost of a bare gRPC stream:
keeping such buffers on the heap doubled its throughput.

:func:`tune_for_bulk_buffers` raises the mmap threshold and the trim threshold so freed buffers
are reused. The price is that up to ``trim_bytes`` of freed memory stays mapped to the process in
each of glibc's arenas; RSS then tracks the peak of a round's in-flight payloads rather than falling
between rounds. It also caps the arenas at :data:`ARENAS`: glibc gives threads their own arenas (up
to 8 per core), and each kept its own cache of freed chunks, so a daemon whose gRPC and worker
threads took turns with pushes grew with every new thread that touched one. A coordinator took
16 MiB pushes one after another, each sent in 1 MiB chunks and then cut (``tests/coordinator/
test_inflight.py``, pinned to 2 cores): eight of them grew it by up to 23 MiB with glibc's arenas
(17 MiB after four on the CI machine), and by none with the cap (at most 7 MiB below where it
started). Its price, ``benchmarks/load.py``, 32 islands over gRPC, two runs each: ingest 0.71 and
0.74 GB/s against 0.75 and 0.78 with glibc's default; ``benchmarks/vs_torchft.py`` at 124M int8, 4
pairs each: the sync 0.93x torchft-nightly's against 0.85x (within that comparison's spread).

Buffers above glibc's mmap ceiling (32 MiB: a large tensor's delta, a codec's temporaries) are
still mapped afresh on every allocation, and first-touching one costs a page fault per 4 KiB page:
~0.1 s for 256 MiB here, five memcpys' worth. PyTorch's CPU allocator can back its buffers of
2 MiB and more with transparent huge pages (``madvise(MADV_HUGEPAGE)``) when
``THP_MEM_ALLOC_ENABLE`` is set, which cut that to ~0.025 s (``benchmarks/codecs.py``). PyTorch
reads the variable once, at its first tensor allocation of any size, so
:func:`tune_for_bulk_buffers` sets it only where it is unset, and it has to run before the
process creates its first tensor. The kernel may compact memory to find huge pages (its
``defrag`` setting), and RSS grows in 2 MiB steps for such buffers.

Set ``ATOLL_MALLOC_TUNING=0`` to keep the allocator's defaults (both of them),
``THP_MEM_ALLOC_ENABLE=0`` to keep only the mallopt settings, or ``ATOLL_MALLOC_ARENAS=N`` for another
cap on the arenas (0: glibc's own).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import sys
import threading

log = logging.getLogger(__name__)

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_M_ARENA_MAX = -8

MMAP_THRESHOLD_BYTES = 32 << 20
"""Allocations below this come from the heap (glibc's own dynamic ceiling on 64-bit)."""
TRIM_THRESHOLD_BYTES = 256 << 20
"""Free memory at the top of the heap kept for reuse before it is returned to the kernel."""
ARENAS = 2
"""The most malloc arenas a tuned process keeps (each holds up to ``trim_bytes`` of freed memory)."""
THP_ENV = "THP_MEM_ALLOC_ENABLE"
"""PyTorch's switch for backing CPU buffers of 2 MiB and more with transparent huge pages."""


def tune_for_bulk_buffers(
    mmap_bytes: int = MMAP_THRESHOLD_BYTES,
    trim_bytes: int = TRIM_THRESHOLD_BYTES,
    *,
    heap: bool = True,
    huge_pages: bool = True,
) -> bool:
    """Apply the settings above; returns whether the mallopt ones took effect (glibc on Linux only).

    ``heap=False``: huge pages only, the allocator's thresholds stay as they are. An island wants
    that: it streams its payloads a tensor at a time and maps large received ones itself, so a heap
    cache would only add up to ``trim_bytes`` to its footprint (measured: 2.3x its shard above the
    model with it, 1.7x without, at 124M parameters). The daemon keeps the cache: it doubles ingest.

    ``huge_pages=False``: the heap settings only (PyTorch's switch is left as the environment has
    it). The daemon wants that: it reuses its large buffers round after round (push buffers, last
    round's update payloads, the replaced θ as the next sum), so it has few first touches to save,
    and the switch cost it resident memory: two islands, a 32 MiB θ, 12 rounds, its peak was 6.2 to
    9.8 |θ| above its start with huge pages and 4.0 to 5.0 |θ| without (about 64 MiB). At 124M
    parameters (``benchmarks/wire.py``) the peak was 5.1 to 5.2 |θ| either way, and push, pull and
    close -> publish took the same time.

    Call it before the process allocates its first tensor, or PyTorch ignores the huge-page one.
    """
    if os.environ.get("ATOLL_MALLOC_TUNING", "1") == "0" or not sys.platform.startswith("linux"):
        return False
    if huge_pages:
        os.environ.setdefault(THP_ENV, "1")  # inherited by the processes this one starts
    if not heap:
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # musl and others: no mallopt
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    settings = [(_M_MMAP_THRESHOLD, mmap_bytes), (_M_TRIM_THRESHOLD, trim_bytes)]
    given = os.environ.get("ATOLL_MALLOC_ARENAS", str(ARENAS))
    if not given.isdigit():
        log.warning("ATOLL_MALLOC_ARENAS=%r is not a whole number >= 0: capping the arenas at %d", given, ARENAS)
    arenas = int(given) if given.isdigit() else ARENAS
    settings += [(_M_ARENA_MAX, arenas)] if arenas > 0 else []
    ok = all(mallopt(option, value) for option, value in settings)
    if not ok:
        log.warning("mallopt refused the bulk-buffer settings; keeping the allocator's defaults")
    return ok


# ---- reusing a buffer nobody reads any more ---------------------------------------------------------
class Lease:
    """One reader's hold on a buffer (:meth:`Leases.take`); :meth:`release` it once it reads no more
    (again: nothing)."""

    def __init__(self, leases: Leases, key, holder: str) -> None:
        self._leases, self._key, self.holder = leases, key, holder

    def release(self) -> None:
        if self._leases is not None:
            self._leases.give_back(self._key, self.holder)
            self._leases = None


class Leases:
    """Who reads the buffers an owner hands out again once nobody does (a buffer reused fills at memory
    speed where a fresh one takes a page fault every 4 KiB). Each reader takes a lease and releases it
    when it reads no more; the owner reuses a buffer only while it holds none, as FSDP2 allocates and
    frees its storages explicitly. A lease is on the memory, not on a Python object: a view of a
    tensor's storage is the same buffer (a reference count, which the view does not raise, took it for
    free). Thread-safe."""

    def __init__(self) -> None:
        self._holders: dict[object, list[str]] = {}
        self._lock = threading.Lock()

    @staticmethod
    def key(buf) -> object:
        """A tensor by its storage (every view of it alike); a bytes-like object by the object that owns
        its memory (a memoryview by the object it views)."""
        if hasattr(buf, "untyped_storage"):  # a torch.Tensor (not imported here: see the module's docstring)
            return ("storage", buf.untyped_storage().data_ptr())
        while isinstance(buf, memoryview) and buf.obj is not None:
            buf = buf.obj
        return ("object", id(buf))

    def take(self, buf, holder: str) -> Lease:
        key = self.key(buf)
        with self._lock:
            self._holders.setdefault(key, []).append(holder)
        return Lease(self, key, holder)

    def give_back(self, key, holder: str) -> None:
        with self._lock:
            holders = self._holders[key]
            holders.remove(holder)
            if not holders:
                del self._holders[key]

    def held(self, buf) -> bool:
        """Whether anyone reads ``buf`` (or any view of its memory) now."""
        with self._lock:
            return self.key(buf) in self._holders

    def holders(self, buf) -> list[str]:
        with self._lock:
            return list(self._holders.get(self.key(buf), ()))
