"""A relay SIGKILLed in the middle of a run: its islands, given ``relay|root``, move to the root by
themselves, and every island's work of every round counts exactly once (real processes)."""

from __future__ import annotations

import json
import signal

import pytest
from support import collect_events, coordinator_flags, http, island_flags, wait_for

from atoll.relay.main import STATE_PREFIX

ROUNDS = 6

pytestmark = pytest.mark.slow  # real processes, tens of seconds each


def start_root(group) -> str:
    """The root: H=4, ROUNDS rounds, a quorum of 3 (the relay's two islands and the one beside it), 3-s leases (a
    dead relay is gone soon), its admin port in a file; returns its address."""
    work = group.work_dir
    flags = coordinator_flags(sync_every=4, quorum=3, extra=["--total-rounds", str(ROUNDS), "--lease-seconds", "3",
                                                             "--admin-port", "0", "--admin-port-file",
                                                             str(work / "admin.port")])  # fmt: skip
    return group.start_coordinator(work / "state", flags, name="root")[1]


def test_islands_move_to_the_root_when_their_relay_dies_and_each_rounds_work_counts_once(group):
    work, rounds = group.work_dir, ROUNDS
    root = start_root(group)
    relay = group.start(
        "relay",
        [
            "relay",
            "--upstream",
            root,
            "--run-id",
            "e2e",
            "--relay-id",
            "eu",
            "--quorum",
            "2",
            "--port-file",
            str(work / "eu.port"),
        ],
    )
    port = wait_for(lambda: (work / "eu.port").exists() and (work / "eu.port").read_text().strip(), what="the port")
    behind = f"127.0.0.1:{port}|{root}"  # the relay, else the root
    islands = [group.start(name, island_flags(behind, name, rounds=None)) for name in ("eu-1", "eu-2")]
    islands.append(group.start("solo", island_flags(root, "solo", rounds=None)))

    killed: list[int] = []

    def until(events) -> bool:
        if not killed and any(e["event"] == "round" and e.get("now_round") == 2 for e in events):
            relay.signal(signal.SIGKILL)  # mid-run: the islands are in round 2
            killed.append(len(events))
        return sum(e["event"] == "done" for e in events) == 3

    events = collect_events(islands, until=until, timeout=300)
    assert killed, "the relay was never killed"
    assert [p.wait(60) for p in islands] == [0, 0, 0]
    assert all(e["run_complete"] for e in events if e["event"] == "done")
    final = [e["digest"] for e in events if e["event"] == "round" and e["now_round"] == rounds]
    assert len(final) == 3 and len(set(final)) == 1, final  # one θ for all, the moved ones too

    admin = (work / "admin.port").read_text().strip()
    status, body = http(f"http://127.0.0.1:{admin}/api/status")
    assert status == 200, body
    history = json.loads(body)["history"]
    assert len(history) == rounds
    for record in history:  # each island's work of each round: in exactly once (through eu, or itself)
        counted = {}
        for key, tokens in record["tokens_by_island"].items():
            if tokens:
                island = key.rsplit("/", 1)[-1]
                assert island not in counted, (record["round"], record["tokens_by_island"])
                counted[island] = key
        assert set(counted) == {"eu-1", "eu-2", "solo"}, (record["round"], record["tokens_by_island"])
    assert any("eu/eu-1" in r["tokens_by_island"] for r in history[:2])  # through the relay at first
    assert all(r["tokens_by_island"].get("eu-1") for r in history[-2:])  # and then at the root itself


def test_a_restarted_relay_takes_its_islands_back_and_no_round_is_lost(group):
    """The relay SIGKILLed and started again on its port: its islands (no other address) wait for it, it
    re-joins the root once its old process's lease has run out (the root's quorum of 3 waits for it),
    takes θ from there, and no island's work is lost."""
    work, rounds = group.work_dir, ROUNDS
    root = start_root(group)
    args = ["relay", "--upstream", root, "--run-id", "e2e", "--relay-id", "eu", "--quorum", "2", "--port-file",
            str(work / "eu.port")]  # fmt: skip
    relay = group.start("relay", args)
    tmp = work / "tmp"  # the group's processes' temporary dirs (TMPDIR): the relays' state dirs are there
    port = wait_for(lambda: (work / "eu.port").exists() and (work / "eu.port").read_text().strip(), what="the port")
    islands = [group.start(name, island_flags(f"127.0.0.1:{port}", name, rounds=None)) for name in ("eu-1", "eu-2")]
    islands.append(group.start("solo", island_flags(root, "solo", rounds=None)))

    restarted: list = []

    def until(events) -> bool:
        if not restarted and any(e["event"] == "round" and e.get("now_round") == 2 for e in events):
            relay.signal(signal.SIGKILL)
            relay.wait(30)
            left = list(tmp.glob(f"{STATE_PREFIX}*"))  # the killed relay's state dir
            restarted.append(group.start("relay-again", [*args, "--port", port]))
            restarted.append(left)
        return sum(e["event"] == "done" for e in events) == 3

    events = collect_events(islands, until=until, timeout=300)
    assert restarted, "the relay was never restarted"
    (killed_dir,) = restarted[1]
    assert not killed_dir.exists() and len(list(tmp.glob(f"{STATE_PREFIX}*"))) == 1  # the new relay's only
    assert [p.wait(60) for p in islands] == [0, 0, 0]
    final = [e["digest"] for e in events if e["event"] == "round" and e["now_round"] == rounds]
    assert len(final) == 3 and len(set(final)) == 1, final

    admin = (work / "admin.port").read_text().strip()
    history = json.loads(http(f"http://127.0.0.1:{admin}/api/status")[1])["history"]
    assert [h["round"] for h in history] == list(range(rounds))  # every round closed
    assert all("eu" in h["islands"] for h in history)  # the relay in each, before and after its restart
    tokens = {}
    for h in history:
        for key, n in h["tokens_by_island"].items():
            tokens[key.rsplit("/", 1)[-1]] = tokens.get(key.rsplit("/", 1)[-1], 0) + n
    # Every island's work entered θ: a push the restarted relay could not count (its island re-joined
    # after the relay's first round closed) is carried into that island's next push, not lost.
    assert tokens == {"eu-1": rounds * 4096, "eu-2": rounds * 4096, "solo": rounds * 4096}, tokens
