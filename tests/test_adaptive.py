"""Adaptive inner steps: an island syncing on a time budget does fewer steps when slow, and its
delta is weighted by the tokens it actually processed."""

import pytest
from conftest import collect_events

from atoll.coordinator.disk import snapshots
from atoll.harness.faults import Fault, island_faults_json


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
