"""Start and stop: DiLoCo.start() keeps the island alive while θ_0 is on its way; the
coordinator's waits give way to a cancellation (its stop)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import grpc
import pytest
import torch
from support import (
    IDENTITY_FLAGS,
    H,
    batches,
    collect_events,
    config,
    coordinator_flags,
    exact_config,
    inner_step,
    island,
    island_flags,
    make_diloco,
    post_json,
    wait_for,
)

from atoll.coordinator.disk import snapshots
from atoll.coordinator.options import AdminOptions
from atoll.coordinator.run.pulls import wait_event
from atoll.coordinator.state.membership import IslandState, island_state
from atoll.islands import CoordinatorRefused
from atoll.protos import coordinator_pb2 as pb
from atoll.protos.reasons import Reason
from atoll.protos.status import reason_of


def test_island_waiting_for_theta0_keeps_its_lease(start_server, raw_island):
    """Island "boot" joins first (so it bootstraps) and takes three leases to upload θ_0. The
    DiLoCo island that joined meanwhile waits in start() on a pull longer than the lease; its
    heartbeats must keep it alive (not "gone", which the round would not wait for), and it must
    start from exactly the θ_0 that was uploaded."""
    lease = 1.0
    srv = start_server(exact_config(run_id="t", sync_every=4, lease_seconds=lease))
    torch.manual_seed(0)
    model = torch.nn.Linear(6, 3)
    theta0 = {n: torch.randn_like(p) for n, p in model.named_parameters()}
    sync = make_diloco(
        model,
        srv.address,
        island_id="waiter",
        run_id="t",
        heartbeat_seconds=0.1,
        pull_wait_seconds=30.0,  # one pull for the whole wait: only heartbeats renew the lease
    )
    boot = raw_island(srv.address, "boot", {n: tuple(t.shape) for n, t in theta0.items()})
    assert boot.join().bootstrap
    uploaded = threading.Event()

    def keep_boot_alive():  # boot stays the bootstrapper only while its lease holds
        beat = pb.HeartbeatRequest(run_id="t", island_id="boot", round=-1)
        while not uploaded.wait(lease / 10):
            boot.client.heartbeat(beat)

    errors: list[BaseException] = []

    def start():
        try:
            sync.start()
        except BaseException as err:  # reported by the test thread
            errors.append(err)

    threads = [threading.Thread(target=keep_boot_alive), threading.Thread(target=start)]
    for t in threads:
        t.start()
    try:
        wait_for(lambda: "waiter" in srv.inspect(lambda s: s.membership.islands), what="the island to join")
        states = []
        for _ in range(30):  # 3 leases
            states.append(srv.inspect(lambda s: island_state(s.membership.islands["waiter"], s.clock(), s.round)))
            time.sleep(lease / 10)
        assert threads[1].is_alive(), f"start() returned before θ_0 existed: {errors}"
        assert set(states) == {IslandState.JOINING}, states
        boot.push(theta0, round_=0, kind=pb.PUSH_KIND_INIT)
        threads[1].join(15)
        assert not threads[1].is_alive() and not errors, errors
        for n, p in model.named_parameters():
            assert torch.equal(p.detach(), theta0[n]), n
    finally:
        uploaded.set()
        for t in threads:
            t.join(15)
        sync.close()


def test_wait_event_is_cancelled_even_when_the_event_fires_in_the_same_iteration():
    """The decider and the pull long-poll wait on events; the server's stop cancels them. A
    cancellation that lands together with the event must still cancel (``asyncio.wait_for``
    swallowed it before Python 3.12, so the decider ran on and stop hung)."""

    async def scenario():
        event = asyncio.Event()
        task = asyncio.create_task(wait_event(event, 10.0))
        for _ in range(3):
            await asyncio.sleep(0)  # the task is waiting
        event.set()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        # Timeouts and a set event still answer as before.
        assert await wait_event(event, 0.0) is True
        t = time.monotonic()
        assert await wait_event(asyncio.Event(), 0.05) is False
        assert time.monotonic() - t >= 0.04

    asyncio.run(scenario())


# ---- operator control ----------------------------------------------------------------------------
def _status(base, token):
    req = urllib.request.Request(base + "/api/status", headers={"Authorization": f"Bearer {token}"})
    with urllib.request.urlopen(req, timeout=10) as resp:
        return json.loads(resp.read())


def coordinator(state, *flags, timeout=60):
    cmd = [sys.executable, "-m", "atoll", "coordinator", "--state-dir", str(state), *flags]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)


# ---- duplicate island ids, dropped pushes ---------------------------------------------------------
def test_a_second_process_with_a_live_island_id_is_refused(start_server):
    srv = start_server(config())
    _, _, first = island(srv.address)
    first.start()
    try:
        _, _, second = island(srv.address)
        with pytest.raises(CoordinatorRefused, match="another live process") as info:
            second.start()
        assert info.value.reason == "REASON_SESSION_CONFLICT"
    finally:
        first.close()


@contextlib.contextmanager
def fast_closes_round_0_without_slow(srv):
    """Two started islands; "fast" runs round 0, which closes at the deadline without "slow"."""
    fast_model, fast_opt, fast = island(srv.address, island_id="fast")
    slow_model, slow_opt, slow = island(srv.address, island_id="slow")
    fast.start()
    slow.start()
    try:
        for b in batches(H):
            fast.step(tokens=32, loss=inner_step(fast_model, fast_opt, b))
        yield fast, (fast_model, fast_opt), slow, (slow_model, slow_opt)
    finally:
        fast.close()
        slow.close()


def test_a_late_push_is_folded_by_default(start_server):
    srv = start_server(config(quorum=1, round_deadline_seconds=0.3))
    with fast_closes_round_0_without_slow(srv) as (_, _, slow, (slow_model, slow_opt)):
        for b in batches(H):
            slow.step(tokens=32, loss=inner_step(slow_model, slow_opt, b))  # folded into round 1
        assert [h.dropped for h in slow.history] == [False] and slow.round == 1
        assert srv.inspect(lambda s: sorted(s.accumulator.late)) == [("slow", 0)]


def test_a_dropped_push_shows_in_round_stats_and_its_island_keeps_its_progress(start_server):
    """(Before: the island of a dropped push took the new θ and lost its H steps.) It re-bases on the
    new θ keeping its local progress, θ ← θ_1 + (θ_local − θ_0), and its next push carries that work
    (Δ relative to θ_1, with the dropped round's steps and tokens added)."""
    srv = start_server(config(quorum=1, round_deadline_seconds=0.3, late_policy="drop"))
    with fast_closes_round_0_without_slow(srv) as (fast, _, slow, (slow_model, slow_opt)):
        data = batches(H)
        theta0 = {k: v.clone() for k, v in slow.global_params().items()}
        for i, b in enumerate(data):
            loss = inner_step(slow_model, slow_opt, b)
            if i == H - 1:
                at_push = {n: p.detach().clone() for n, p in slow_model.named_parameters()}
            slow.step(tokens=32, loss=loss)
        assert [h.dropped for h in fast.history] == [False]
        assert [h.dropped for h in slow.history] == [True] and slow.round == 1
        theta1 = slow.global_params()
        for n, p in slow_model.named_parameters():
            assert torch.allclose(p.detach(), theta1[n] + (at_push[n] - theta0[n]), atol=1e-6)
            assert not torch.allclose(p.detach(), theta1[n])  # its progress is kept
        for (name, *_), v in slow.pseudo_gradient().items():  # and is in its next push
            assert torch.allclose(v, theta0[name] - at_push[name], atol=1e-6)
        for b in data:  # slow commits round 1 first this time
            slow.step(tokens=32, loss=inner_step(slow_model, slow_opt, b))
        record = srv.inspect(lambda s: dict(s.history[1]))
        assert record["steps_by_island"]["slow"] == 2 * H and record["tokens_by_island"]["slow"] == 2 * H * 32


# ---- the run's end --------------------------------------------------------------------------------
@pytest.mark.timeout(240)
def test_total_rounds_end_the_run_and_islands_stop_by_themselves(group, tmp_path):
    coord, address = group.start_coordinator(
        tmp_path / "state", coordinator_flags(sync_every=5, quorum=2, extra=["--total-rounds", "3"])
    )
    procs = [group.start(f"i{k}", island_flags(address, f"i{k}", rounds=None)) for k in range(2)]
    events = collect_events(procs, until=lambda ev: sum(e["event"] == "done" for e in ev) == 2, timeout=180)
    assert [p.wait(30) for p in procs] == [0, 0]
    assert sorted(e["round"] for e in events if e["event"] == "round") == [0, 0, 1, 1, 2, 2]
    assert all(e["run_complete"] for e in events if e["event"] == "done")
    # A restarted island (even one asking for more rounds) never pushes past the end.
    late = group.start("late", island_flags(address, "i0", rounds=5))
    done = collect_events([late], until=lambda ev: any(e["event"] == "done" for e in ev), timeout=60)
    assert late.wait(30) == 0 and done[-1]["run_complete"] and not [e for e in done if e["event"] == "round"]
    assert len(snapshots.load_live(tmp_path / "state").history) == 3
    coord.stop()


def test_a_stalled_quorum_is_reported_and_cleared_live(start_server, raw_island, caplog):
    """Quorum 2, one site dies for good: the run says it is stuck and how to unblock it; the operator
    evicts the dead island and lowers the quorum over the admin API; the round closes."""
    caplog.set_level(logging.WARNING, logger="atoll")
    srv = start_server(config(quorum=2, lease_seconds=0.5), admin=AdminOptions(port=0, token="tok"))
    base = srv.server.admin.address
    shapes = {"w": (3, 2)}
    a, b = raw_island(srv.address, "a", shapes), raw_island(srv.address, "b", shapes)
    a.join()
    b.join()
    a.push({"w": torch.randn(3, 2)}, round_=0, kind=pb.PUSH_KIND_INIT)
    a.push({"w": torch.randn(3, 2)}, round_=0, tokens=3)
    deadline = time.monotonic() + 10
    while not _status(base, "tok")["stall"]:  # b stops calling: its lease lapses
        a.client.heartbeat(pb.HeartbeatRequest(run_id="t", island_id="a"))
        assert time.monotonic() < deadline
        time.sleep(0.1)
    stall = _status(base, "tok")["stall"]
    assert "cannot reach quorum 2" in stall and "gone: b" in stall and "quorum 1" in stall
    while not any("cannot reach quorum" in r.getMessage() for r in caplog.records):  # at WARNING after a lease
        assert time.monotonic() < deadline + 5
        a.client.heartbeat(pb.HeartbeatRequest(run_id="t", island_id="a"))
        time.sleep(0.1)
    assert post_json(base + "/api/islands/b/evict", {}, "wrong")[0] == 401
    assert post_json(base + "/api/islands/nobody/evict", {}, "tok")[0] == 404
    assert post_json(base + "/api/islands/b/evict", {}, "tok")[0] == 200
    code, body = post_json(base + "/api/config", {"quorum": 1}, "tok")
    assert code == 200 and body["changed"] == ["quorum: 2 -> 1"]
    assert post_json(base + "/api/config", {"codec": "int8"}, "tok")[0] == 400  # math: not on a live run
    header, _ = a.pull(0, wait_seconds=10)
    assert header.round == 1
    states = {i["island"]: i["state"] for i in _status(base, "tok")["islands"]}
    assert states == {"a": "active", "b": "evicted"}
    with pytest.raises(grpc.RpcError) as info:
        b.join()
    assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED


def test_a_restart_applies_operational_flags_refuses_math_ones_and_forgets_who_left(group, tmp_path, raw_island):
    state = tmp_path / "state"
    coord, address = group.start_coordinator(
        state, ["--run-id", "t", "--sync-every", "1", "--quorum", "2", *IDENTITY_FLAGS]
    )
    shapes = {"w": (3, 2)}
    a, b = raw_island(address, "a", shapes), raw_island(address, "b", shapes)
    a.join()
    b.join()
    a.push({"w": torch.randn(3, 2)}, round_=0, kind=pb.PUSH_KIND_INIT)
    a.push({"w": torch.randn(3, 2)}, round_=0, tokens=1)
    b.push({"w": torch.randn(3, 2)}, round_=0, tokens=1)
    assert a.pull(0)[0].round == 1
    b.client.leave(pb.LeaveRequest(run_id="t", island_id="b"))
    coord.stop()

    refused = coordinator(state, "--run-id", "t", "--codec", "int8", "--outer-lr", "0.5")
    last = refused.stderr.strip().splitlines()[-1]
    assert refused.returncode == 1 and "Traceback" not in refused.stderr
    assert "codec (run: 'identity', asked: 'int8')" in last and "outer_lr (run: 0.7, asked: 0.5)" in last
    other = coordinator(state, "--run-id", "other")
    assert other.returncode == 1 and "holds run 't', not 'other'" in other.stderr.strip().splitlines()[-1]

    coord, address = group.start_coordinator(state, ["--run-id", "t", "--quorum", "1"], name="again")
    log = coord.log_tail(20000)
    assert "quorum: 2 -> 1 (from the command line)" in log
    a = raw_island(address, "a", shapes)
    a.join()
    a.push({"w": torch.randn(3, 2)}, round_=1, tokens=1)
    assert a.pull(1)[0].round == 2  # b left: with quorum 1 the round closes on a alone
    coord.stop()  # before reading its dir: a live one prunes what its background writer superseded
    snap = snapshots.load(state)
    assert snap.config.quorum == 1 and snap.history[-1]["islands"] == ["a"] and "b" not in snap.islands


SHAPES = {"w": (4, 3), "b": (5,)}


def rand(shapes=SHAPES):
    return {k: torch.randn(s) for k, s in shapes.items()}


# ---- a rogue first island -----------------------------------------------------------------------
WRONG = {"w": (7, 7)}


def test_a_bootstrapper_that_leaves_releases_its_claim(start_server, raw_island):
    """An island with a wrong model joins first and leaves before uploading θ_0: the next island
    bootstraps with its own model. (Before: every real island was refused from then on.)"""
    srv = start_server(exact_config(run_id="t", sync_every=1))
    rogue = raw_island(srv.address, "rogue", WRONG)
    assert rogue.join().bootstrap
    rogue.client.leave(pb.LeaveRequest(run_id="t", island_id="rogue"))
    real = raw_island(srv.address, "real", SHAPES)
    assert real.join().bootstrap
    real.push(rand(), round_=0, kind=pb.PUSH_KIND_INIT)
    assert srv.inspect(lambda s: {k: tuple(v.shape) for k, v in s.model.params.items()}) == SHAPES


def test_a_silent_bootstrapper_passes_the_claim_to_a_waiting_island(start_server, raw_island):
    """The rogue lets its lease lapse; an island that joined meanwhile and waits in its pull is told
    to upload θ_0 (UpdateHeader.bootstrap), and its model becomes the run's."""
    srv = start_server(exact_config(run_id="t", sync_every=1, lease_seconds=1.0))
    rogue = raw_island(srv.address, "rogue", WRONG)
    assert rogue.join().bootstrap
    real = raw_island(srv.address, "real", SHAPES)
    assert not real.join().bootstrap
    header, _ = real.pull(-1, wait_seconds=3.0)
    while header.kind == pb.UPDATE_KIND_NOT_READY and not header.bootstrap:
        header, _ = real.pull(-1, wait_seconds=3.0)
    assert header.bootstrap
    real.push(rand(), round_=0, kind=pb.PUSH_KIND_INIT)
    header, payloads = real.pull(-1)
    assert header.kind == pb.UPDATE_KIND_FULL and [n for n, _ in payloads] == sorted(SHAPES, reverse=True)
    with pytest.raises(grpc.RpcError) as info:  # the rogue, back, is now refused
        rogue.join()
    assert reason_of(info.value) is Reason.MODEL_MISMATCH


def test_island_rounds_follow_the_runs_count_not_only_its_pushes():
    """`atoll island --rounds N` pushes at most N times and stops once it holds θ of the round it started
    at plus N. An island that lost a round (its update broke at a coordinator restart and it pulled a
    later θ) counted its pushes only: it pushed one round more than its peers, after they had left."""
    from types import SimpleNamespace

    from atoll.workload.island import rounds_left

    peer = SimpleNamespace(round=0, rounds_pushed=0)
    lost = SimpleNamespace(round=0, rounds_pushed=0)
    for r in range(3):  # both push rounds 0, 1, 2; the lost one jumps from θ_1 to θ_3 after round 1
        assert rounds_left(peer, 3, 0, 3) == 3 - r
        peer.round, peer.rounds_pushed = r + 1, r + 1
    assert rounds_left(peer, 3, 0, 3) == 0
    lost.round, lost.rounds_pushed = 1, 1
    assert rounds_left(lost, 3, 0, 3) == 2
    lost.round, lost.rounds_pushed = 3, 2  # its push of round 1 went with the lost round: it pulled θ_3
    assert rounds_left(lost, 3, 0, 3) == 0  # before: one push left, for round 3, which nobody else pushed
    overlapping = SimpleNamespace(round=2, rounds_pushed=3)  # its third push is out, not applied yet
    assert rounds_left(overlapping, 3, 0, 3) == 0


def test_an_islands_last_round_does_not_wait_for_a_quorum_that_is_gone(start_server):
    """Quorum 2: b leaves after round 0, a's last round can never close. Told it is its last, a's wait
    ends with QuorumGone (saying why) instead of lasting until islands come back."""
    from atoll.islands import QuorumGone

    srv = start_server(config(quorum=2, lease_seconds=60.0))
    a_model, a_opt, a = island(srv.address, island_id="a", pull_wait_seconds=0.5)
    b_model, b_opt, b = island(srv.address, island_id="b", pull_wait_seconds=0.5)
    a.start()
    b.start()
    try:
        data = batches(2 * H)
        threads = []
        for sync, model, opt in ((a, a_model, a_opt), (b, b_model, b_opt)):

            def one_round(sync=sync, model=model, opt=opt):
                for batch in data[:H]:
                    sync.step(tokens=32, loss=inner_step(model, opt, batch))

            threads.append(threading.Thread(target=one_round))
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert a.round == b.round == 1
        b.close()
        a.last_round()
        started = time.monotonic()
        with pytest.raises(QuorumGone, match="round 1 can never close"):
            for batch in data[H:]:
                a.step(tokens=32, loss=inner_step(a_model, a_opt, batch))
        assert time.monotonic() - started < 10
    finally:
        a.close()
        b.close()


def test_a_run_that_ends_as_configured_is_logged_at_info_not_warning(start_server, raw_island, caplog):
    """(Before: "run t is complete after 1 rounds" at WARNING.)"""
    caplog.set_level(logging.INFO)
    srv = start_server(exact_config(run_id="t", sync_every=1, total_rounds=1))
    a = raw_island(srv.address, "a", {"w": (2, 2)})
    a.join()
    a.push({"w": torch.ones(2, 2)}, round_=0, kind=pb.PUSH_KIND_INIT)
    a.push({"w": torch.ones(2, 2)}, round_=0, tokens=1)
    a.pull(0)
    ended = [r for r in caplog.records if "is complete after 1 rounds" in r.getMessage()]
    assert len(ended) == 1 and ended[0].levelno == logging.INFO
