"""``atoll coordinator --standby`` against a real object store (SeaweedFS): a hot standby follows the
run as its records land (θ and momentum in memory, bitwise the primary's), watches the lease on its
own clock, takes the run over the moment the lease lapses, and islands given ``primary|standby`` move
to it by themselves. Bad input: one line, exit 2."""

from __future__ import annotations

import re
import signal
import socket
import subprocess
import sys
import time

import pytest
import torch
from support import collect_events, coordinator_flags, exact_config, island_flags, wait_for
from support.stores import run_rounds, state_of

from atoll.coordinator.disk import wal
from atoll.coordinator.disk.follow import Follower
from atoll.coordinator.disk.store import ObjectState
from atoll.coordinator.options import StorageOptions
from atoll.harness.seaweed import free_ports
from atoll.lease import DRIFT, Lease, LeaseWatch
from atoll.objects import ObjectStore, StoreError

pytestmark = pytest.mark.usefixtures("s3_server")


def test_the_watch_calls_a_lease_lapsed_after_its_length_unrenewed_on_the_watchers_clock(s3_url):
    """No wall clock: a renewal restarts the wait; a lease left alone for its length (+1%) is lapsed;
    of two standbys taking it, one wins; the old holder finds it lost at its next renewal."""
    store = ObjectStore.from_url(s3_url)
    now = [100.0]
    holder = Lease(store, 4.0).acquire()
    holder._stop.set()  # (renewed by hand below: a frozen holder is one that stops renewing)
    try:
        watch = LeaseWatch(store, monotonic=lambda: now[0])
        assert watch.read().left == pytest.approx(4.0 * (1 + DRIFT))
        now[0] += 3.0
        holder.renew()  # renewed: the wait starts over from the read that sees it
        timing = holder.timing.to_json(holder.seconds)
        assert timing["renewals"] == 1 and 0 < timing["put_seconds_max"] == timing["put_seconds_mean"] < 4.0
        assert 0 < timing["unrenewed_seconds_max"] < 4.0  # (from its acquire to this renewal's start)
        assert watch.read().left == pytest.approx(4.0 * (1 + DRIFT))
        now[0] += 4.0
        assert 0 < watch.read().left < 0.1
        now[0] += 0.1
        seen = watch.read()
        assert seen.left == 0 and seen.owner == holder.owner
        first = Lease(store, 4.0).take_over(seen.etag)
        try:
            with pytest.raises(StoreError, match="changed hands"):
                Lease(store, 4.0).take_over(seen.etag)  # the second standby of a race
            with pytest.raises(StoreError):
                holder.renew()
            assert holder.lost == "another coordinator took the lease"
        finally:
            first.release()
        assert watch.read().left == 0  # given back by a clean stop: taken at once
    finally:
        holder.release()


def test_a_follower_holds_the_primarys_theta_and_momentum_bitwise_as_rounds_land(s3_url, start_server, tmp_path):
    store = ObjectStore.from_url(s3_url)
    config = exact_config(run_id="t", sync_every=2, outer_momentum=0.9)
    primary = start_server(
        config, tmp_path / "w1", store=ObjectState(store, lease_seconds=5.0), storage=StorageOptions(snapshot_every=2)
    )
    run_rounds(primary, 3)

    def up():  # what the background writes after each publish, in the store
        primary.inspect(lambda s: s.writer.wait())
        primary.inspect(lambda s: s.store.mirror.flush())

    up()
    follower = Follower(store, tmp_path / "standby", "t")
    follower.start()
    try:
        for rounds, seed in ((3, None), (6, 1)):
            if seed is not None:
                run_rounds(primary, rounds, seed=seed)
                up()
                assert follower.catch_up() == 3
            r, theta, momentum, _ = state_of(primary)
            assert follower.snap.round == r == rounds
            assert all(torch.equal(theta[k], follower.snap.params[k]) for k in theta)
            assert follower.optimizer_round == r
            assert all(torch.equal(momentum[k], follower.snap.extra[k]) for k in momentum)
        assert follower.catch_up() == 0  # nothing new: nothing fetched
    finally:
        follower.release()
        primary.stop()


@pytest.mark.parametrize("exact", [False, True])
def test_with_exact_failover_the_momentum_is_in_the_store_before_the_publish(s3_url, start_server, tmp_path, exact):
    """What goes up after a publish is held back here (a primary that dies right after each publish):
    the store then holds every round's record but, without ``--exact-failover``, no optimizer state past
    θ_0's, so a standby would go on with stale momentum; with it, the state of the newest round, bitwise
    the primary's."""
    store = ObjectStore.from_url(s3_url)
    config = exact_config(run_id="t", sync_every=2, outer_momentum=0.9)
    primary = start_server(
        config,
        tmp_path / "w1",
        store=ObjectState(store, lease_seconds=5.0),
        storage=StorageOptions(snapshot_every=100, exact_failover=exact),
    )
    try:
        primary.inspect(lambda s: setattr(s.store.mirror, "sync_later", lambda: None))  # nothing after a publish
        run_rounds(primary, 3)
        r, theta, momentum, _ = state_of(primary)
        follower = Follower(store, tmp_path / "standby", "t")
        follower.start()
        try:
            notes = follower.final()
            assert follower.snap.round == r == 3
            assert all(torch.equal(theta[k], follower.snap.params[k]) for k in theta)
            if not exact:
                assert follower.optimizer_round == 0 and "continuing with round 0's momentum" in notes[0]
                return
            assert notes == [] and follower.optimizer_round == 3
            assert all(torch.equal(momentum[k], follower.snap.extra[k]) for k in momentum)
        finally:
            follower.release()
    finally:
        primary.stop()


def newest_record(work_dir) -> int:
    """The newest round whose record a working dir holds (-1: none)."""
    return max((r for r, _ in wal.records(work_dir)), default=-1)


def assert_one_theta_per_round(events, rounds: int, first: int = 0) -> None:
    """One publisher per round: every island holds the same θ (its digest) after each round."""
    digests = {}
    for e in events:
        if e["event"] == "round":
            digests.setdefault(e["round"], set()).add(e["digest"])
    assert sorted(digests) == list(range(first, rounds))
    assert all(len(d) == 1 and None not in d for d in digests.values()), digests


def _coordinator(args, env, timeout=30):
    return subprocess.run(
        [sys.executable, "-m", "atoll", "coordinator", *args], capture_output=True, text=True, env=env, timeout=timeout
    )


def test_a_standby_that_cannot_follow_says_why_in_one_line_and_exits_2(s3_server, s3_url, start_server, tmp_path):
    env = {**__import__("os").environ, **s3_server.env()}
    local = _coordinator(["--standby", "--state-dir", str(tmp_path / "local")], env)
    assert local.returncode == 2 and local.stderr.count("\n") == 1, local.stderr
    assert "a standby on another machine cannot follow a local dir" in local.stderr
    with socket.socket() as taken:  # a port it could not serve on at the takeover: said at its start
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        busy = ["--standby", "--state-dir", s3_url, "--port", str(taken.getsockname()[1])]
        busy = _coordinator([*busy, "--work-dir", str(tmp_path / "b")], env)
    assert busy.returncode == 1 and busy.stderr.count("\n") == 1, busy.stderr
    assert "is in use" in busy.stderr
    exact = _coordinator(["--exact-failover", "--state-dir", str(tmp_path / "local")], env)
    assert exact.returncode == 2 and exact.stderr.count("\n") == 1, exact.stderr
    assert "--exact-failover is for a run a standby follows in an object store" in exact.stderr
    empty = _coordinator(["--standby", "--state-dir", s3_url + "-none", "--work-dir", str(tmp_path / "e")], env)
    assert empty.returncode == 2 and "holds no run and no coordinator holds it" in empty.stderr, empty.stderr
    assert empty.stderr.strip().count("\n") == 0, empty.stderr

    primary = start_server(exact_config(run_id="t"), tmp_path / "w1", store=ObjectState(ObjectStore.from_url(s3_url)))
    try:
        run_rounds(primary, 1)
        other = _coordinator(
            ["--standby", "--state-dir", s3_url, "--run-id", "other", "--work-dir", str(tmp_path / "o")], env
        )
        assert other.returncode == 2 and "holds run 't', not 'other'" in other.stderr, other.stderr
        assert other.stderr.strip().count("\n") == 0, other.stderr
    finally:
        primary.stop()


def test_sigkill_of_the_primary_the_standby_takes_over_and_no_round_is_lost(group, s3_server, s3_url, tmp_path):
    """Real processes: a primary, a standby on the same store (its own port and working dir, no port
    until it serves) and two islands given ``primary|standby``. The primary is SIGKILLed mid-run; the
    standby takes over once the 2 s lease lapses, from memory, and the islands finish every round."""
    env = s3_server.env()
    port, bulk, port2, bulk2 = free_ports(4)
    flags = [*coordinator_flags(sync_every=20, quorum=2), "--store-lease-seconds", "2"]
    primary, address = group.start_coordinator(
        s3_url, [*flags, "--bulk-port", str(bulk), "--work-dir", str(tmp_path / "w1")], port=port, env=env
    )
    port_file = tmp_path / "standby.port"
    standby = group.start_standby(
        s3_url,
        [*flags, "--bulk-port", str(bulk2), "--work-dir", str(tmp_path / "w2"), "--port-file", str(port_file)],
        port=port2,
        env=env,
    )
    rounds = 5
    both = f"{address}|127.0.0.1:{port2}"
    islands = [group.start(f"island-{i}", island_flags(both, f"island-{i}", rounds=rounds)) for i in range(2)]
    events = collect_events(
        islands, until=lambda ev: sum(e["event"] == "round" and e["round"] == 1 for e in ev) == 2, timeout=240
    )
    wait_for(lambda: "following run e2e" in standby.log_tail(100_000), timeout=30, what="the standby to follow")
    assert not port_file.exists()  # a standby serves nothing
    primary.signal(signal.SIGKILL)
    killed = time.monotonic()
    primary.wait(10)
    events = []
    events += collect_events(
        islands, until=lambda ev: any(e["event"] == "round" and e["round"] == 2 for e in ev), timeout=120
    )
    moved_on = time.monotonic() - killed
    events += collect_events(islands, until=lambda ev: sum(e["event"] == "done" for e in ev) == 2, timeout=300)
    assert [p.wait(30) for p in islands] == [0, 0]
    log = standby.log_tail(200_000)
    assert "standby: took over run e2e" in log and port_file.exists()
    standby.stop()
    for k in ("island-0", "island-1"):
        assert [e["round"] for e in events if e["event"] == "round" and e["island"] == k] == list(range(2, rounds))
    assert_one_theta_per_round(events, rounds, first=2)
    print(f"kill -> round 2 closed on the standby: {moved_on:.2f} s")
    assert moved_on < 20, moved_on


def test_a_frozen_standby_never_takes_a_live_run_and_of_two_standbys_one_takes_over(group, s3_server, s3_url, tmp_path):
    """The hard orders with real processes, a 2 s lease: a standby frozen (SIGSTOP) for twice the lease
    while it follows wakes to a lease renewed meanwhile and leaves the live primary alone; the primary
    SIGKILLed with two standbys watching: one takes the run, the other goes on following the new
    holder and takes over in turn when that one is killed. One publisher per round: every round in the
    store once, each island sees every round."""
    env = s3_server.env()
    ports = free_ports(6)
    flags = [*coordinator_flags(sync_every=40, quorum=2), "--store-lease-seconds", "2"]
    primary, address = group.start_coordinator(
        s3_url, [*flags, "--bulk-port", str(ports[1]), "--work-dir", str(tmp_path / "w0")], port=ports[0], env=env
    )
    standbys = {
        k: group.start_standby(
            s3_url,
            [*flags, "--bulk-port", str(ports[2 * k + 1]), "--work-dir", str(tmp_path / f"w{k}")],
            port=ports[2 * k],
            name=f"standby-{k}",
            env=env,
        )
        for k in (1, 2)
    }
    rounds = 14
    addresses = "|".join(f"127.0.0.1:{ports[2 * k]}" for k in range(3))
    islands = [group.start(f"island-{i}", island_flags(addresses, f"island-{i}", rounds=rounds)) for i in range(2)]

    def log(k):
        return standbys[k].log_tail(200_000)

    def seen(ev, r):
        return any(e["event"] == "round" and e["round"] == r for e in ev)

    events = collect_events(islands, until=lambda ev: seen(ev, 1), timeout=240)
    for k in (1, 2):
        wait_for(lambda k=k: "following run e2e" in log(k), timeout=60, what=f"standby {k} to follow")
    standbys[1].signal(signal.SIGSTOP)
    time.sleep(2 * 2.0 * (1 + DRIFT) + 0.5)  # frozen past two leases (on the wall); the primary renews meanwhile
    standbys[1].signal(signal.SIGCONT)
    at_wake = newest_record(tmp_path / "w0")
    # Awake, it reads the lease (renewed: its wait starts over) before it fetches what landed meanwhile.
    wait_for(lambda: newest_record(tmp_path / "w1") > at_wake, timeout=60, what="the woken standby to follow")
    assert primary.poll() is None and "took over" not in log(1) + log(2)
    events += collect_events(islands, until=lambda ev: sum(e["event"] == "round" for e in ev) >= 2, timeout=120)
    primary.signal(signal.SIGKILL)
    primary.wait(10)
    wait_for(lambda: "took over" in log(1) + log(2), timeout=30, what="a standby to take over")
    winner = 1 if "standby: took over" in log(1) else 2
    loser = 3 - winner
    took = int(re.search(r"took over run e2e in \S+ at round (\d+)", log(winner)).group(1))
    # The other one follows the new holder: it fetches the record of the round the winner closed first.
    wait_for(lambda: newest_record(tmp_path / f"w{loser}") >= took, timeout=60, what="the other to follow")
    assert "standby: took over" not in log(loser) and standbys[loser].poll() is None
    last = max(e["round"] for e in events if e["event"] == "round")
    events += collect_events(islands, until=lambda ev: seen(ev, last + 2), timeout=120)
    standbys[winner].signal(signal.SIGKILL)
    standbys[winner].wait(10)
    wait_for(lambda: "standby: took over" in log(loser), timeout=30, what="the other standby to take over")
    events += collect_events(islands, until=lambda ev: sum(e["event"] == "done" for e in ev) == 2, timeout=300)
    assert [p.wait(30) for p in islands] == [0, 0]
    standbys[loser].stop()
    for k in ("island-0", "island-1"):
        assert [e["round"] for e in events if e["event"] == "round" and e["island"] == k] == list(range(rounds))
    assert_one_theta_per_round(events, rounds)
