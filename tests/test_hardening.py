"""The coordinator against faults and hostile input (issue: hardening), each through the real server.

Every test here failed on the code before the fix; what it pins is said in its docstring.
"""

from __future__ import annotations

import errno
import json
import logging
import math
import urllib.error
import urllib.request

import grpc
import pytest
import torch

from atoll.coordinator import RunConfig, persistence
from atoll.protos import coordinator_pb2 as pb
from atoll.protos.status import reason_of

SHAPES = {"w": (4, 3), "b": (5,)}


def rand(shapes=SHAPES):
    return {k: torch.randn(s) for k, s in shapes.items()}


def get(url, token=None, headers=None):
    h = dict(headers or {})
    if token:
        h["Authorization"] = f"Bearer {token}"
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=h), timeout=10) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode()


# ---- 1. a failed save -------------------------------------------------------------------------
def test_failed_save_keeps_the_round_unpublished_reports_it_and_recovers(start_server, raw_island, monkeypatch, caplog):
    """A full disk at the close of round 0: the round stays unpublished, an ERROR names the cause,
    /healthz answers 503 with it, and the round is published by itself once saving works again.
    (Before: the decider task died silently; /healthz said ok; rounds never closed again.)"""
    srv = start_server(RunConfig(run_id="t", sync_every=1), admin_port=0)
    base = srv.server.admin.address
    a = raw_island(srv.address, "a", SHAPES)
    a.join()
    a.push(rand(), round_=0, kind=pb.PUSH_KIND_INIT)
    real_save = persistence.save
    disk = {"full": True}

    def save(*args, **kwargs):
        if disk["full"]:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_save(*args, **kwargs)

    monkeypatch.setattr(persistence, "save", save)
    caplog.set_level(logging.INFO, logger="atoll")
    assert a.push(rand(), round_=0, tokens=4).committed
    header, _ = a.pull(0, wait_seconds=1.5)
    assert header.kind == pb.UPDATE_KIND_NOT_READY and header.round == 0
    code, body = get(base + "/healthz")
    assert code == 503 and "No space left on device" in body
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR and "No space left on device" in r.getMessage()]
    assert errors, "no ERROR names the failed save"
    disk["full"] = False
    header, _ = a.pull(0, wait_seconds=20)
    assert header.kind == pb.UPDATE_KIND_DELTA and header.round == 1
    assert get(base + "/healthz")[0] == 200
    assert persistence.load(srv.server.state_dir).round == 1


# ---- 4. a rogue first island --------------------------------------------------------------------
WRONG = {"w": (7, 7)}


def test_a_bootstrapper_that_leaves_releases_its_claim(start_server, raw_island):
    """An island with a wrong model joins first and leaves before uploading θ_0: the next island
    bootstraps with its own model. (Before: every real island was refused from then on.)"""
    srv = start_server(RunConfig(run_id="t", sync_every=1))
    rogue = raw_island(srv.address, "rogue", WRONG)
    assert rogue.join().bootstrap
    rogue.client.leave(pb.LeaveRequest(run_id="t", island_id="rogue"))
    real = raw_island(srv.address, "real", SHAPES)
    assert real.join().bootstrap
    real.push(rand(), round_=0, kind=pb.PUSH_KIND_INIT)
    assert srv.inspect(lambda s: {k: tuple(v.shape) for k, v in s.params.items()}) == SHAPES


def test_a_silent_bootstrapper_passes_the_claim_to_a_waiting_island(start_server, raw_island):
    """The rogue lets its lease lapse; an island that joined meanwhile and waits in its pull is told
    to upload θ_0 (UpdateHeader.bootstrap), and its model becomes the run's."""
    srv = start_server(RunConfig(run_id="t", sync_every=1, lease_seconds=1.0))
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
    assert reason_of(info.value) == "REASON_MODEL_MISMATCH"


# ---- 5. error codes -----------------------------------------------------------------------------
def test_unparseable_request_bytes_answer_invalid_argument(start_server):
    """(Before: UNKNOWN, from protobuf's DecodeError.)"""
    srv = start_server()
    with grpc.insecure_channel(srv.address) as channel:
        for method in ("Join", "Heartbeat", "Leave"):
            call = channel.unary_unary(f"/atoll.v1.Coordinator/{method}")
            with pytest.raises(grpc.RpcError) as info:
                call(b"\xff\xff\xff\xff\x0f", timeout=5)
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, method
            assert reason_of(info.value) == "REASON_BAD_REQUEST"
        pull = channel.unary_stream("/atoll.v1.Coordinator/PullUpdate")
        with pytest.raises(grpc.RpcError) as info:
            list(pull(b"\x0a\xff", timeout=5))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_unknown_method_without_a_token_is_unimplemented_without_a_traceback(start_server, tmp_path, caplog):
    """With --island-tokens, an unknown method called without a token. (Before: UNKNOWN, and a
    server traceback logged per call.)"""
    from atoll.coordinator.security import IslandTokens

    srv = start_server(tokens=IslandTokens({"a": "tok-a"}))
    caplog.set_level(logging.DEBUG)
    with grpc.insecure_channel(srv.address) as channel:
        with pytest.raises(grpc.RpcError) as info:
            channel.unary_unary("/atoll.v1.Coordinator/Nope")(b"", timeout=5)
        assert info.value.code() == grpc.StatusCode.UNIMPLEMENTED
        with pytest.raises(grpc.RpcError) as info:
            channel.unary_unary("/atoll.v1.Coordinator/Join")(b"", timeout=5)
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert reason_of(info.value) == "REASON_UNAUTHENTICATED"
    assert not [r for r in caplog.records if r.exc_info or "Traceback" in r.getMessage()]


def test_dashboard_accepts_the_token_in_the_authorization_header(start_server):
    """(Before: only ?token= worked for the page, while the API took only the header.)"""
    srv = start_server(admin_port=0, admin_token="s3cret")
    base = srv.server.admin.address
    assert get(base + "/", token="s3cret")[0] == 200
    assert get(base + "/dashboard?token=s3cret")[0] == 200
    assert get(base + "/", token="wrong")[0] == 401


# ---- 6. token weight ----------------------------------------------------------------------------
def test_absurd_token_claims_are_refused(start_server, raw_island):
    """tokens = 2^64 - 1 would take nearly all of the mean's weight. (Before: accepted.)"""
    srv = start_server(RunConfig(run_id="t", sync_every=10, quorum=2))
    a, b = raw_island(srv.address, "a", SHAPES), raw_island(srv.address, "b", SHAPES)
    a.join()
    b.join()
    a.push(rand(), round_=0, kind=pb.PUSH_KIND_INIT)
    with pytest.raises(grpc.RpcError) as info:
        b.push(rand(), round_=0, tokens=2**64 - 1)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert reason_of(info.value) == "REASON_TOKENS_OUT_OF_RANGE"
    assert str(10 * 2**24) in info.value.details()  # the default bound: H x 2^24
    assert srv.inspect(lambda s: s.staging.committed_islands()) == []


def test_token_bound_is_a_run_setting(start_server, raw_island):
    srv = start_server(RunConfig(run_id="t", sync_every=1, max_tokens_per_round=1000))
    a = raw_island(srv.address, "a", SHAPES)
    a.join()
    a.push(rand(), round_=0, kind=pb.PUSH_KIND_INIT)
    with pytest.raises(grpc.RpcError, match="1000"):
        a.push(rand(), round_=0, tokens=1001)
    assert a.push(rand(), round_=0, tokens=1000).committed


# ---- 7. outcomes as data ------------------------------------------------------------------------
def test_a_push_for_a_closed_round_is_an_outcome_not_an_error_text(start_server, raw_island):
    srv = start_server(RunConfig(run_id="t", sync_every=1, quorum=1, round_deadline_seconds=0.2))
    a, b = raw_island(srv.address, "a", SHAPES), raw_island(srv.address, "b", SHAPES)
    a.join()
    b.join()
    a.push(rand(), round_=0, kind=pb.PUSH_KIND_INIT)
    a.push(rand(), round_=0, tokens=3)
    assert a.pull(0)[0].round == 1  # closed at the deadline without b
    resp = b.push(rand(), round_=0, tokens=3)
    assert resp.outcome == pb.PUSH_OUTCOME_ROUND_CLOSED and not resp.committed
    assert a.push(rand(), round_=1, tokens=3).outcome == pb.PUSH_OUTCOME_COMMITTED
    assert a.push(rand(), round_=1, tokens=3).outcome == pb.PUSH_OUTCOME_DUPLICATE


def test_refusals_carry_a_reason(start_server, raw_island):
    srv = start_server(RunConfig(run_id="t", sync_every=1))
    ghost = raw_island(srv.address, "ghost", SHAPES)
    with pytest.raises(grpc.RpcError) as info:
        ghost.pull(-1)
    assert info.value.code() == grpc.StatusCode.NOT_FOUND and reason_of(info.value) == "REASON_NOT_JOINED"
    other = raw_island(srv.address, "x", SHAPES, run_id="other")
    with pytest.raises(grpc.RpcError) as info:
        other.join()
    assert reason_of(info.value) == "REASON_WRONG_RUN"


def test_an_island_ahead_of_the_coordinator_is_served_the_full_parameters(start_server, raw_island):
    """After an operator rolls the coordinator back, an island holding a newer round gets the full θ
    as an answer (UPDATE_KIND_FULL), not a FAILED_PRECONDITION it has to interpret."""
    srv = start_server(RunConfig(run_id="t", sync_every=1))
    a = raw_island(srv.address, "a", SHAPES)
    a.join()
    theta = rand()
    a.push(theta, round_=0, kind=pb.PUSH_KIND_INIT)
    header, payloads = a.pull(5)
    assert header.kind == pb.UPDATE_KIND_FULL and header.round == 0


# ---- counters -----------------------------------------------------------------------------------
def test_a_norm_bound_refusal_is_counted_once(start_server, raw_island):
    srv = start_server(RunConfig(run_id="t", sync_every=1, max_delta_norm=1.0))
    a = raw_island(srv.address, "a", SHAPES)
    a.join()
    a.push(rand(), round_=0, kind=pb.PUSH_KIND_INIT)
    with pytest.raises(grpc.RpcError) as info:
        a.push({k: v * 100 for k, v in rand().items()}, round_=0, tokens=1)
    assert reason_of(info.value) == "REASON_DELTA_TOO_LARGE"
    assert srv.server.counters.pushes_refused == 1


def test_no_nan_loss_is_reported_for_a_round_without_tokens(start_server, raw_island):
    """A round whose islands sent no token counts reports their mean loss, not 0.0."""
    srv = start_server(RunConfig(run_id="t", sync_every=1))
    a = raw_island(srv.address, "a", SHAPES)
    a.join()
    a.push(rand(), round_=0, kind=pb.PUSH_KIND_INIT)
    a.push(rand(), round_=0, loss=2.5)
    header, _ = a.pull(0)
    assert math.isclose(header.loss, 2.5)


def test_status_json_is_valid_with_a_closed_round(start_server, raw_island):
    srv = start_server(RunConfig(run_id="t", sync_every=1), admin_port=0)
    a = raw_island(srv.address, "a", SHAPES)
    a.join()
    a.push(rand(), round_=0, kind=pb.PUSH_KIND_INIT)
    a.push(rand(), round_=0, tokens=2, loss=1.0)
    a.pull(0)
    code, body = get(srv.server.admin.address + "/api/status")
    assert code == 200 and json.loads(body)["round"] == 1


# ---- 1b. the real thing: a full disk, and a task that dies -------------------------------------
def _mount_namespaces() -> bool:
    import shutil
    import subprocess

    if shutil.which("unshare") is None:
        return False
    probe = subprocess.run(
        ["unshare", "-m", "sh", "-c", "mount -t tmpfs -o size=1m tmpfs /mnt && umount /mnt"], capture_output=True
    )
    return probe.returncode == 0


@pytest.mark.timeout(120)
@pytest.mark.skipif(not _mount_namespaces(), reason="needs unshare -m and tmpfs mounts (root)")
def test_a_state_dir_on_a_full_tmpfs_recovers_when_space_returns(tmp_path, raw_island):
    """The coordinator process with its state dir on a 24 MiB tmpfs in a mount namespace of its own;
    the test fills the disk (through /proc/PID/root), a round's save fails with ENOSPC, the daemon
    says so and keeps the round unpublished; the filler goes, the round is published."""
    import os
    import subprocess
    import sys
    import time

    state = tmp_path / "state"
    state.mkdir()
    port_file, admin_file = tmp_path / "port", tmp_path / "admin"
    log = open(tmp_path / "coordinator.log", "wb")  # noqa: SIM115 - closed below
    cmd = (
        f"mount -t tmpfs -o size=24m tmpfs {state} && exec {sys.executable} -m atoll coordinator "
        f"--state-dir {state} --run-id t --sync-every 1 --port-file {port_file} --admin-port 0 "
        f"--admin-port-file {admin_file}"
    )
    proc = subprocess.Popen(["unshare", "-m", "sh", "-c", cmd], stdout=log, stderr=log)
    try:
        deadline = time.monotonic() + 60
        while not (port_file.exists() and admin_file.exists()):
            assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "coordinator.log").read_text()
            time.sleep(0.05)
        address = f"127.0.0.1:{port_file.read_text().strip()}"
        admin = f"http://127.0.0.1:{admin_file.read_text().strip()}"
        shapes = {"w": (1024, 1024)}  # a 4 MiB θ: each snapshot is 8 MiB
        a = raw_island(address, "a", shapes)
        a.join()
        a.push({"w": torch.randn(1024, 1024)}, round_=0, kind=pb.PUSH_KIND_INIT)
        inside = f"/proc/{proc.pid}/root{state}"
        filler = f"{inside}/filler"
        with open(filler, "wb", buffering=0) as f, pytest.raises(OSError):  # fill it: no room for a snapshot
            while True:
                f.write(b"\0" * (1 << 20))
                f.flush()
        a.push({"w": torch.randn(1024, 1024) * 0.01}, round_=0, tokens=1)
        header, _ = a.pull(0, wait_seconds=2.0)
        assert header.kind == pb.UPDATE_KIND_NOT_READY
        deadline = time.monotonic() + 10
        while get(admin + "/healthz")[0] != 503:
            assert time.monotonic() < deadline
            time.sleep(0.1)
        assert "No space left on device" in get(admin + "/healthz")[1]
        os.unlink(filler)
        header, _ = a.pull(0, wait_seconds=30)
        assert header.kind == pb.UPDATE_KIND_DELTA and header.round == 1
        assert get(admin + "/healthz")[0] == 200
    finally:
        proc.terminate()
        proc.wait(20)
        log.close()
    text = (tmp_path / "coordinator.log").read_text()
    assert "ERROR" in text and "No space left on device" in text and "saving works again" in text


@pytest.mark.timeout(60)
def test_a_dead_background_task_ends_the_daemon_with_a_non_zero_exit(tmp_path):
    """A bug in the round decider (here: decide() raising) is logged with its traceback and the
    process exits 1, for its supervisor to restart it. (Before: the task died silently and the
    daemon went on answering, with rounds that never closed.)"""
    import subprocess
    import sys

    script = (
        "import sys, atoll.coordinator.closing as c\n"
        "def broken(*a, **k):\n"
        "    raise RuntimeError('a bug in decide')\n"
        "c.decide = broken\n"
        "from atoll.cli import main\n"
        f"sys.exit(main(['coordinator', '--state-dir', r'{tmp_path / 'state'}', '--run-id', 't']))\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        # No θ yet: the decider does not decide. Bootstrap one island to wake it.
        out = proc.stdout.readline()
        address = out.strip().rsplit(" ", 1)[-1]
        from conftest import RawIsland

        a = RawIsland(address, "a", {"w": (2, 2)})
        a.join()
        a.push({"w": torch.zeros(2, 2)}, round_=0, kind=pb.PUSH_KIND_INIT)
        a.close()
        assert proc.wait(30) == 1
    finally:
        if proc.poll() is None:
            proc.kill()
    err = proc.stderr.read()
    assert "background task atoll-decider died" in err and "a bug in decide" in err
