"""End to end with real processes: a coordinator and islands on loopback."""

import signal

import pytest
from support import collect_events, coordinator_flags, island_flags, wait_for

from atoll.coordinator.disk import snapshots


def rounds_by_island(events):
    out = {}
    for e in events:
        if e["event"] == "round":
            out.setdefault(e["island"], []).append(e)
    return out


def check_identical_and_learning(events, num_islands, rounds):
    joined = [e for e in events if e["event"] == "joined"]
    assert len(joined) == num_islands
    assert len({e["digest"] for e in joined}) == 1, "islands did not start from the same θ"
    by_island = rounds_by_island(events)
    assert sorted(by_island) == sorted(e["island"] for e in joined)
    for evs in by_island.values():
        assert [e["round"] for e in evs] == list(range(rounds))
    for r in range(rounds):
        digests = {evs[r]["digest"] for evs in by_island.values()}
        assert len(digests) == 1, f"islands hold different θ after round {r}"
    start = joined[0]["eval_loss"]
    final = next(iter(by_island.values()))[-1]["eval_loss"]
    return start, final


def test_two_islands_train_and_hold_identical_parameters(group, tmp_path):
    coord, address = group.start_coordinator(tmp_path / "state", coordinator_flags(sync_every=20, quorum=2))
    islands = [group.start(f"island-{i}", island_flags(address, f"island-{i}", rounds=5)) for i in range(2)]
    events = collect_events(islands, until=lambda ev: sum(e["event"] == "done" for e in ev) == 2, timeout=240)
    assert [p.wait(30) for p in islands] == [0, 0]
    start, final = check_identical_and_learning(events, 2, 5)
    assert start > 3.5 and final < 0.8 * start, (start, final)
    # The islands' global loss falls too, and the coordinator persisted every round with both islands.
    global_losses = [e["global_loss"] for e in rounds_by_island(events)["island-0"]]
    assert global_losses[-1] < global_losses[0]
    coord.stop()
    snap = snapshots.load(tmp_path / "state")
    assert snap.round == 5
    assert [h["round"] for h in snap.history] == list(range(5))
    assert all(h["islands"] == ["island-0", "island-1"] for h in snap.history)
    # Bytes on the wire: each push carries every parameter as fp32 plus framing.
    num_params = sum(v.numel() for v in snap.params.values())
    sent = [e["bytes_sent"] for e in rounds_by_island(events)["island-0"]]
    assert all(4 * num_params < s < 4 * num_params * 1.02 for s in sent), (sent, num_params)


@pytest.mark.slow
def test_coordinator_sigkill_between_rounds_resumes(group, tmp_path):
    state = tmp_path / "state"
    flags = coordinator_flags(sync_every=20, quorum=2)
    coord, address = group.start_coordinator(state, flags)
    port = int(address.rsplit(":", 1)[1])
    rounds = 8
    islands = [group.start(f"island-{i}", island_flags(address, f"island-{i}", rounds=rounds)) for i in range(2)]

    def both_finished(r):
        return lambda ev: (
            {e["island"] for e in ev if e["event"] == "round" and e["round"] == r} == {"island-0", "island-1"}
        )

    events = collect_events(islands, until=both_finished(2), timeout=240)

    def retries(p):
        return p.log_path.read_text(errors="replace").count("retrying")

    before = [retries(p) for p in islands]
    coord.signal(signal.SIGKILL)
    coord.wait(10)
    persisted = snapshots.load(state).round
    assert persisted >= 3  # round 2 closed (both islands applied it), so it is on disk
    wait_for(  # islands keep training, and retry while the coordinator is down
        lambda: all(retries(p) > n for p, n in zip(islands, before, strict=True)),
        timeout=60,
        what="both islands to find the coordinator gone",
    )
    coord2, address2 = group.start_coordinator(state, flags, name="coordinator-restarted", port=port)
    assert address2 == address
    events += collect_events(islands, until=lambda ev: sum(e["event"] == "done" for e in ev) == 2, timeout=300)
    assert [p.wait(30) for p in islands] == [0, 0]
    start, final = check_identical_and_learning(events, 2, rounds)
    assert final < 0.8 * start
    coord2.stop()
    snap = snapshots.load(state)
    assert snap.round == rounds
    # No completed round lost or repeated across the restart.
    assert [h["round"] for h in snap.history] == list(range(rounds))
    assert f"restored run e2e at round {persisted}" in coord2.log_tail(100_000)
