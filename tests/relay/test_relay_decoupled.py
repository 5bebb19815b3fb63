"""Decoupled rounds through a relay (real processes): islands behind it train without waiting, the relay
forwards once per round of its own, and the run ends on one global θ with every island's work in it."""

from __future__ import annotations

import json

import pytest
from support import collect_events, coordinator_flags, http, island_flags, wait_for

pytestmark = pytest.mark.slow  # real processes, tens of seconds each


def test_decoupled_islands_behind_a_relay_finish_on_one_theta_with_all_their_work(group):
    work = group.work_dir
    rounds = 5
    flags = coordinator_flags(sync_every=4, quorum=3, extra=["--outer-mode", "decoupled", "--total-rounds",
                                                             str(rounds), "--admin-port", "0", "--admin-port-file",
                                                             str(work / "admin.port")])  # fmt: skip
    _, root = group.start_coordinator(work / "state", flags, name="root")
    group.start("relay", ["relay", "--upstream", root, "--run-id", "e2e", "--relay-id", "eu", "--quorum", "2",
                          "--port-file", str(work / "eu.port")])  # fmt: skip
    port = wait_for(lambda: (work / "eu.port").exists() and (work / "eu.port").read_text().strip(), what="the port")
    islands = [group.start(n, island_flags(f"127.0.0.1:{port}", n, rounds=None)) for n in ("eu-1", "eu-2")]
    islands.append(group.start("solo", island_flags(root, "solo", rounds=None)))
    events = collect_events(islands, until=lambda ev: sum(e["event"] == "done" for e in ev) == 3, timeout=300)
    assert [p.wait(60) for p in islands] == [0, 0, 0]
    assert all(e["run_complete"] for e in events if e["event"] == "done")
    final = {e["digest"] for e in events if e["event"] == "round" and e["now_round"] == rounds}
    assert len(final) == 1, final  # the global θ every island ends on

    admin = (work / "admin.port").read_text().strip()
    history = json.loads(http(f"http://127.0.0.1:{admin}/api/status")[1])["history"]
    assert [h["round"] for h in history] == list(range(rounds))
    for h in history:  # each round: both islands through the relay (its quorum of 2), and the one beside it
        assert {k for k, v in h["tokens_by_island"].items() if v} == {"eu/eu-1", "eu/eu-2", "solo"}, h
        assert h["share"] > 0
