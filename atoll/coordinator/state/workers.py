"""Tensor work spread over the coordinator's cores, one tensor per task, results taken in order.

The outer step and a push's decode-add are a loop over θ's tensors in which each tensor's work touches
that tensor's storage only (its sum, momentum, error feedback, payload). :class:`TensorWorkers` runs
those loop bodies on a few threads at once (torch's kernels let the GIL go), and hands each result
back in the loop's own order, on the calling thread, as soon as it and all before it are done: a
record or a pull streaming the update still gets tensor after tensor, the first ones early.

Every element still goes through the same operations in the same order (a tensor's work is never
split between tasks), so θ and the payloads keep their bits whatever the number of workers.

Why threads of its own rather than torch's intra-op threads: on a machine whose cores the islands
share (the dev machine: three processes on two cores), an intra-op parallel kernel waits at its end
for its slowest thread, and one that is descheduled stalls the whole pass; two tasks on two threads
each go on at their own pace. Each task's kernels still use torch's intra-op threads as configured
(``--threads``).
"""

from __future__ import annotations

import concurrent.futures
import os
from collections.abc import Callable, Iterable
from typing import TypeVar

K = TypeVar("K")
R = TypeVar("R")

MAX_AUTO = 4
"""At most this many workers when the count is derived from the machine (elementwise passes are
limited by memory bandwidth well before a socket's cores are busy)."""


def auto_count(threads: int, cpus: int | None = None) -> int:
    """Workers for ``threads`` torch intra-op threads (0: torch's default, one per core) on ``cpus``
    cores: the cores the intra-op threads leave idle get a worker each, at most :data:`MAX_AUTO`.
    With torch's default every core is in each kernel already: one worker."""
    cpus = cpus or usable_cpus()
    if threads <= 0 or threads >= cpus:
        return 1
    return max(1, min(MAX_AUTO, cpus // threads))


def usable_cpus() -> int:
    """The cores this process may run on (its affinity: a container's CPU set), else the machine's."""
    try:
        return len(os.sched_getaffinity(0)) or 1
    except (AttributeError, OSError):
        return os.cpu_count() or 1


class TensorWorkers:
    """``count`` threads for tensor work (1: the caller's own thread, no pool)."""

    def __init__(self, count: int = 1) -> None:
        if count < 1:
            raise ValueError(f"tensor workers must be at least 1, got {count}")
        self.count = count
        self._pool = (
            concurrent.futures.ThreadPoolExecutor(count, thread_name_prefix="atoll-tensors") if count > 1 else None
        )

    def ordered(self, tasks: Iterable[tuple[K, Callable[[], R]]], done: Callable[[K, R], None] | None = None) -> None:
        """Run each ``(key, task)``; call ``done(key, result)`` on this thread in the tasks' order.
        If a task raises, the tasks not started are dropped, those running are waited for (none is
        left touching a tensor after this returns), and the first error in order is raised."""
        if self._pool is None:
            for key, task in tasks:
                result = task()
                if done is not None:
                    done(key, result)
            return
        futures = [(key, self._pool.submit(task)) for key, task in tasks]
        try:
            for key, future in futures:
                result = future.result()
                if done is not None:
                    done(key, result)
        except BaseException:
            for _, future in futures:
                future.cancel()
            concurrent.futures.wait([f for _, f in futures])
            raise

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)


SERIAL = TensorWorkers(1)
"""Everything on the caller's thread (tests, offline tools)."""
