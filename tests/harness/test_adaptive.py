"""Adaptive inner steps: an island syncing on a time budget does fewer steps when slow, and its
delta is weighted by the tokens it actually processed."""

import pytest
from support import FakeClock, collect_events

from atoll.coordinator.disk import snapshots
from atoll.harness.faults import Fault, island_faults_json
from atoll.islands._schedule import Schedule


def test_a_time_budget_syncs_a_slow_island_after_fewer_steps_with_the_tokens_it_took():
    def steps_until_due(seconds_per_step: float) -> tuple[int, int]:
        clock = FakeClock(0.0)
        sched = Schedule(1, streaming=False, sync_every_seconds=1.0, clock=clock)
        sched.begin(40)  # the run's H does not count on a time budget
        while not sched.budget_spent():
            clock.now += seconds_per_step
            sched.count(tokens=32, loss=1.0)
        took = sched.routes[0].steps, sched.routes[0].tokens
        sched.synced([0])
        assert not sched.budget_spent() and sched.routes[0].steps == 0  # the next budget starts now
        return took

    assert steps_until_due(0.125) == (8, 8 * 32)
    assert steps_until_due(0.5) == (2, 2 * 32)  # 4x slower: a quarter of the steps and tokens


@pytest.mark.slow  # three processes, tens of seconds
@pytest.mark.timeout(300)
def test_time_budget_island_does_fewer_steps_and_weighs_its_tokens(group, tmp_path):
    coord, address = group.start_coordinator(
        tmp_path / "state", ["--run-id", "ad", "--sync-every", "40", "--quorum", "2", "--round-deadline-seconds", "120"]
    )
    slow = [Fault(island="T", round=0, kind="slow", factor=4.0, rounds=100)]
    procs = [
        group.start("H", ["island", "--coordinator", address, "--island-id", "H", "--run-id", "ad", "--rounds", "3"]),
        group.start(
            "T",
            [
                "island",
                "--coordinator",
                address,
                "--island-id",
                "T",
                "--run-id",
                "ad",
                "--rounds",
                "3",
                "--sync-every-seconds",
                "1.0",
            ],
            faults=island_faults_json(slow, "T"),
        ),
    ]
    events = collect_events(procs, until=lambda ev: sum(e["event"] == "done" for e in ev) == 2, timeout=240)
    assert [p.wait(30) for p in procs] == [0, 0]
    coord.stop()
    rounds = {(e["island"], e["round"]): e for e in events if e["event"] == "round"}
    for r in range(3):
        h, t = rounds[("H", r)], rounds[("T", r)]
        assert h["inner_steps"] == 40
        assert 1 <= t["inner_steps"] < 40  # the slow island stopped at its 1 s budget
        assert t["tokens"] == t["inner_steps"] * 16 * 64 and h["tokens"] == 40 * 16 * 64
    hist = snapshots.load(tmp_path / "state").history
    for r, record in enumerate(hist):  # the coordinator weighted by the tokens each island reported
        assert record["tokens"] == rounds[("H", r)]["tokens"] + rounds[("T", r)]["tokens"]
