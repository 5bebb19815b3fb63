"""The outer step and a push's decode-add on several threads at once (issue 53, items 2 and 3): the
results come back in order, a failure leaves no task running, and a push's decode keeps the bits of
one tensor after another (the outer step's: tests/coordinator/test_outer_step.py)."""

from __future__ import annotations

import threading

import pytest
import torch

from atoll.compression import get_codec
from atoll.coordinator.regions import Region
from atoll.coordinator.state.accumulator import accumulate
from atoll.coordinator.state.plans import EntryPlan, PushPlan, StagedRank
from atoll.coordinator.state.workers import SERIAL, TensorWorkers, auto_count


@pytest.fixture
def workers():
    made: list[TensorWorkers] = []

    def make(count: int) -> TensorWorkers:
        made.append(TensorWorkers(count))
        return made[-1]

    yield make
    for w in made:
        w.close()


def test_results_come_back_in_order_while_later_tasks_run_beside_earlier_ones(workers):
    """Task 0 finishes only once task 2 has run: on one thread that never happens (the wait times out
    and says so); on three, task 0's result is still handed back first, on the calling thread."""
    ran_2 = threading.Event()

    def first() -> str:
        return "0 after 2" if ran_2.wait(10) else "0 alone"

    def third() -> str:
        ran_2.set()
        return "2"

    handed = []
    workers(3).ordered(
        [(0, first), (1, lambda: "1"), (2, third)],
        lambda key, got: handed.append((key, got, threading.current_thread() is threading.main_thread())),
    )
    assert handed == [(0, "0 after 2", True), (1, "1", True), (2, "2", True)]


def test_a_failing_task_is_raised_only_once_the_tasks_running_beside_it_are_done(workers):
    """Task 1 is still running when task 0 fails: it waits for a release the test gives only once
    ``ordered`` has returned. ``ordered`` must wait for it, so task 1 ends by its own timeout, unreleased;
    had ``ordered`` returned at the failure, the release would have reached task 1 first."""
    running, failed, released, ends = threading.Event(), threading.Event(), threading.Event(), []

    def fails() -> None:
        running.wait(10)
        failed.set()
        raise RuntimeError("task 0 failed")

    def busy() -> None:
        running.set()
        failed.wait(10)
        ends.append("released" if released.wait(0.5) else "ran to its end")

    with pytest.raises(RuntimeError, match="task 0 failed"):
        workers(2).ordered([(0, fails), (1, busy)])
    released.set()
    assert ends == ["ran to its end"]


def test_a_callback_that_fails_stops_the_run_too(workers):
    def done(key, _):
        if key == 1:
            raise ValueError("the record could not take tensor 1")

    got = []
    with pytest.raises(ValueError, match="tensor 1"):
        workers(2).ordered([(k, (lambda k=k: got.append(k))) for k in range(6)], done)


@pytest.mark.parametrize(
    ("threads", "cpus", "want"),
    [(0, 2, 1), (2, 2, 1), (3, 2, 1), (1, 2, 2), (1, 16, 4), (4, 16, 4), (8, 16, 2), (1, 1, 1)],
)
def test_the_default_count_takes_the_cores_the_intra_op_threads_leave(threads, cpus, want):
    assert auto_count(threads, cpus) == want


def test_a_count_below_one_is_refused():
    with pytest.raises(ValueError, match="at least 1, got 0"):
        TensorWorkers(0)


@pytest.mark.parametrize("spec", ["int8", "identity", "sparse"])
def test_a_push_decoded_on_several_workers_is_bitwise_the_serial_one(workers, spec):
    """Three islands of two ranks each (row halves of one tensor, the whole of another, column halves
    of a third: a tensor's regions come from both ranks) into a sum that holds old values (counted
    as zero): on 1 and on 3 threads, the same bits."""
    codec = get_codec(spec)
    gen = torch.Generator().manual_seed(7)
    shapes = {"rows": (64, 48), "whole": (300, 7), "cols": (40, 30)}
    layout = [  # (rank, tensor, region)
        (0, "rows", Region((0, 0), (32, 48))),
        (0, "whole", Region((0, 0), (300, 7))),
        (0, "cols", Region((0, 0), (40, 15))),
        (1, "cols", Region((0, 15), (40, 15))),
        (1, "rows", Region((32, 0), (32, 48))),
    ]

    def island(scale: float) -> list[StagedRank]:
        delta = {k: torch.randn(s, generator=gen) * scale for k, s in shapes.items()}
        ranks = []
        for rank in (0, 1):
            entries, payloads = [], []
            for _, name, region in (x for x in layout if x[0] == rank):
                payload = codec.encode(delta[name][region.slices()].contiguous(), {})
                entries.append(EntryPlan(name, region, len(payload)))
                payloads.append(payload)
            ranks.append(StagedRank(PushPlan("x", 0, False, rank, 2, 1, None, spec, tuple(entries)), payloads))
        return ranks

    islands = [(island(s), w) for s, w in ((1.0, 3.0), (1e-3, 7.0), (0.3, 0.5))]
    sums = {}
    for n, pool in ((1, SERIAL), (3, workers(3))):
        accum = {k: torch.full(s, float("nan")) for k, s in shapes.items()}
        stale = set(shapes)
        for ranks, weight in islands:
            accumulate(ranks, accum, codec, weight, stale, pool)
        assert not stale
        sums[n] = accum
    for name in shapes:
        assert not sums[1][name].isnan().any(), name
        assert torch.equal(sums[1][name], sums[3][name]), name
