"""Long runs: an island's exact resume from its own state, the run's end, operator control, duplicate
island ids, dropped pushes, getting the model out (issue: long runs)."""

from __future__ import annotations

import copy
import json
import logging
import subprocess
import sys
import time
import urllib.error
import urllib.request

import grpc
import pytest
import torch
from conftest import ServerThread, collect_events, coordinator_flags, inner_step, island_flags

from atoll.coordinator import RunConfig, persistence
from atoll.islands import CoordinatorRefused, DiLoCo
from atoll.islands.client import RetryPolicy
from atoll.protos import coordinator_pb2 as pb

H = 4


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))


def batches(n: int):
    gen = torch.Generator().manual_seed(3)
    return [(torch.randn(32, 8, generator=gen), torch.randn(32, 4, generator=gen)) for _ in range(n)]


def config(**kw) -> RunConfig:
    return RunConfig(run_id="t", sync_every=H, outer_lr=0.7, outer_momentum=0.9, **kw)


def island(address, **kw):
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    kw.setdefault("island_id", "solo")
    sync = DiLoCo(model, opt, coordinator=address, run_id="t", retry=RetryPolicy(give_up_seconds=20), **kw)
    return model, opt, sync


def theta(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


# ---- an island resumes exactly ------------------------------------------------------------------
@pytest.mark.parametrize("codec", ["identity", "int8"])
def test_an_island_restarted_from_its_state_ends_bitwise_where_it_would_have(start_server, tmp_path, codec):
    """The island checkpoints at each push (``before_push``), dies two steps into round 2, and a new
    process restarts from the checkpoint: it re-pushes round 1 (the coordinator has it), does not
    redo it, and after 5 rounds the island and the coordinator hold bitwise the θ of a run that was
    never interrupted. AdamW moments, the data position and the error-feedback residuals included."""
    steps = 5 * H
    data = batches(steps)
    ef = dict(error_feedback=True, error_feedback_decay=0.5) if codec != "identity" else {}

    ref = start_server(config(codec=codec, **ef), tmp_path / "ref")
    model, opt, sync = island(ref.address)
    sync.start()
    for b in data:
        sync.step(tokens=32, loss=inner_step(model, opt, b))
    sync.close()
    want, want_coord = theta(model), ref.inspect(lambda s: {k: v.clone() for k, v in s.params.items()})

    srv = start_server(config(codec=codec, **ef), tmp_path / "run")
    saved = {}

    def checkpoint(s: DiLoCo) -> None:  # what atoll island --checkpoint-dir saves at each push
        saved.update(step=s.inner_steps, model=copy.deepcopy(model.state_dict()), opt=copy.deepcopy(opt.state_dict()))
        saved["diloco"] = copy.deepcopy(s.state_dict())

    model, opt, sync = island(srv.address, before_push=checkpoint)
    sync.start()
    for b in data[: 2 * H + 2]:  # dies two steps into round 2, its push of round 1 in
        sync.step(tokens=32, loss=inner_step(model, opt, b))
    assert saved["step"] == 2 * H and saved["diloco"]["flights"][0]["round"] == 1
    sync.close(leave=False)  # the process is gone; its lease is still live

    model, opt, sync = island(srv.address)
    model.load_state_dict(saved["model"])
    opt.load_state_dict(saved["opt"])
    sync.load_state_dict(saved["diloco"])
    sync.start()  # same session: welcome back; round 1 re-pushed: a duplicate
    assert sync.round == 2 and srv.inspect(lambda s: s.history[1]["islands"]) == ["solo"]
    for b in data[saved["step"] :]:
        sync.step(tokens=32, loss=inner_step(model, opt, b))
    sync.close()
    got = theta(model)
    for n in want:
        assert torch.equal(got[n], want[n]), n
    coord = srv.inspect(lambda s: {k: v.clone() for k, v in s.params.items()})
    assert all(torch.equal(coord[k], want_coord[k]) for k in want_coord)
    assert srv.inspect(lambda s: s.round) == 5


def test_a_state_of_another_island_is_refused(start_server):
    srv = start_server(config())
    model, opt, sync = island(srv.address)
    sync.start()
    state = sync.state_dict()
    sync.close()
    _, _, other = island(srv.address, island_id="other")
    with pytest.raises(ValueError, match="island 'solo'"):
        other.load_state_dict(state)


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


def test_the_same_process_rejoins_a_restarted_coordinator(tmp_path):
    """A coordinator restart forgets nobody's session: the island's next call re-joins it."""
    srv = ServerThread(config(), tmp_path / "state").start()
    port = srv.server.port
    model, opt, sync = island(srv.address, heartbeat_seconds=0.2)
    try:
        sync.start()
        for b in batches(H):
            sync.step(tokens=32, loss=inner_step(model, opt, b))
        srv.stop()
        srv = ServerThread(config(), tmp_path / "state", port=port).start()
        for b in batches(H):
            sync.step(tokens=32, loss=inner_step(model, opt, b))
        assert srv.inspect(lambda s: s.round) == 2
    finally:
        sync.close()
        srv.stop()


def test_a_dropped_push_shows_in_round_stats(start_server):
    srv = start_server(config(quorum=1, round_deadline_seconds=0.3))
    fast_model, fast_opt, fast = island(srv.address, island_id="fast")
    slow_model, slow_opt, slow = island(srv.address, island_id="slow")
    fast.start()
    slow.start()
    try:
        data = batches(H)
        for b in data:
            fast.step(tokens=32, loss=inner_step(fast_model, fast_opt, b))  # round 0 closes without slow
        for b in data:
            slow.step(tokens=32, loss=inner_step(slow_model, slow_opt, b))
        assert [h.dropped for h in fast.history] == [False]
        assert [h.dropped for h in slow.history] == [True] and slow.round == 1
    finally:
        fast.close()
        slow.close()


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
    assert len(persistence.load(tmp_path / "state").history) == 3
    coord.stop()


# ---- operator control ----------------------------------------------------------------------------
def _post(url, body, token):
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST")
    req.add_header("Authorization", f"Bearer {token}")
    req.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode()


def _status(base, token):
    req = urllib.request.Request(base + "/api/status", headers={"Authorization": f"Bearer {token}"})
    with urllib.request.urlopen(req, timeout=10) as resp:
        return json.loads(resp.read())


def test_a_stalled_quorum_is_reported_and_cleared_live(start_server, raw_island, caplog):
    """Quorum 2, one site dies for good: the run says it is stuck and how to unblock it; the operator
    evicts the dead island and lowers the quorum over the admin API; the round closes."""
    caplog.set_level(logging.WARNING, logger="atoll")
    srv = start_server(config(quorum=2, lease_seconds=0.5), admin_port=0, admin_token="tok")
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
    assert any("cannot reach quorum" in r.getMessage() for r in caplog.records)
    assert _post(base + "/api/islands/b/evict", {}, "wrong")[0] == 401
    assert _post(base + "/api/islands/nobody/evict", {}, "tok")[0] == 404
    assert _post(base + "/api/islands/b/evict", {}, "tok")[0] == 200
    code, body = _post(base + "/api/config", {"quorum": 1}, "tok")
    assert code == 200 and body["changed"] == ["quorum: 2 -> 1"]
    assert _post(base + "/api/config", {"codec": "int8"}, "tok")[0] == 400  # math: not on a live run
    header, _ = a.pull(0, wait_seconds=10)
    assert header.round == 1
    states = {i["island"]: i["state"] for i in _status(base, "tok")["islands"]}
    assert states == {"a": "active", "b": "evicted"}
    with pytest.raises(grpc.RpcError) as info:
        b.join()
    assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED


def test_control_endpoints_need_a_token(start_server):
    srv = start_server(admin_port=0)
    code, body = _post(srv.server.admin.address + "/api/config", {"quorum": 1}, "")
    assert code == 403 and "--admin-token" in body


def coordinator(state, *flags, timeout=60):
    cmd = [sys.executable, "-m", "atoll", "coordinator", "--state-dir", str(state), *flags]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)


def test_a_restart_applies_operational_flags_refuses_math_ones_and_forgets_who_left(group, tmp_path, raw_island):
    state = tmp_path / "state"
    coord, address = group.start_coordinator(state, ["--run-id", "t", "--sync-every", "1", "--quorum", "2"])
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
    snap = persistence.load(state)
    assert snap.config.quorum == 1 and snap.history[-1]["islands"] == ["a"] and "b" not in snap.islands
    coord.stop()


# ---- getting the model out -------------------------------------------------------------------------
def test_export_writes_theta_with_the_models_own_names(start_server, tmp_path):
    from safetensors.torch import load_file

    srv = start_server(config(), tmp_path / "state")
    model, opt, sync = island(srv.address)
    sync.start()
    for b in batches(2 * H):
        sync.step(tokens=32, loss=inner_step(model, opt, b))
    sync.close()
    out = tmp_path / "model.safetensors"
    done = subprocess.run(
        [sys.executable, "-m", "atoll", "export", "--state-dir", str(tmp_path / "state"), "--out", str(out)],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr
    assert "at round 2" in done.stdout
    fresh = make_model()
    fresh.load_state_dict(load_file(str(out)))  # strict: every name matches
    for n, p in fresh.named_parameters():
        assert torch.equal(p, dict(model.named_parameters())[n])
    older = subprocess.run(
        [
            sys.executable,
            "-m",
            "atoll",
            "export",
            "--state-dir",
            str(tmp_path / "state"),
            "--out",
            str(out),
            "--round",
            "1",
        ],
        capture_output=True,
        text=True,
    )
    assert older.returncode == 0 and "at round 1" in older.stdout


@pytest.mark.timeout(300)
def test_a_sigkilled_island_process_resumes_from_its_checkpoint_bitwise(tmp_path):
    """``atoll island --checkpoint-dir``, SIGKILLed a few steps into round 2 and restarted with the
    same command: the run ends with bitwise the θ (and the per-round losses) of the run that was never
    interrupted (model and AdamW state via torch.distributed.checkpoint, data position, RNG, DiLoCo
    state). benchmarks/resume.py measures heal time and checkpoint cost on the same code."""
    import argparse

    from benchmarks.resume import run

    args = argparse.Namespace(rounds=4, sync_every=10, kill_after_round=1, kill_delay=0.2)
    ref = run(tmp_path / "ref", args, kill=False)
    got = run(tmp_path / "killed", args, kill=True)
    assert got["round"] == ref["round"] == 4
    assert got["digest"] == ref["digest"]
    assert [h["loss"] for h in got["history"]] == [h["loss"] for h in ref["history"]]
    assert got["heal_seconds"] < 60
