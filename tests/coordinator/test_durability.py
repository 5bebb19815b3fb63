"""Nothing published is lost and no background task dies silently: a failing save keeps the round
unpublished and recovers, a full disk, a dead decider."""

from __future__ import annotations

import errno
import logging

import pytest
import torch
from support import IDENTITY_FLAGS, ServerThread, exact_config, http, wait_for

from atoll.coordinator.disk import lock, snapshots, wal
from atoll.coordinator.options import AdminOptions
from atoll.protos import coordinator_pb2 as pb

SHAPES = {"w": (4, 3), "b": (5,)}


def rand(shapes=SHAPES):
    return {k: torch.randn(s) for k, s in shapes.items()}


# ---- the real thing: a full disk, and a task that dies -------------------------------------
def _mount_namespaces() -> bool:
    import shutil
    import subprocess

    if shutil.which("unshare") is None:
        return False
    probe = subprocess.run(
        ["unshare", "-m", "sh", "-c", "mount -t tmpfs -o size=1m tmpfs /mnt && umount /mnt"], capture_output=True
    )
    return probe.returncode == 0


# ---- a failed save ----------------------------------------------------------------------------
def test_failed_save_keeps_the_round_unpublished_reports_it_and_recovers(start_server, raw_island, monkeypatch, caplog):
    """A full disk at the close of round 0: the round stays unpublished, an ERROR names the cause,
    /healthz answers 503 with it, and the round is published by itself once saving works again.
    (Before: the decider task died silently; /healthz said ok; rounds never closed again.)"""
    srv = start_server(exact_config(run_id="t", sync_every=1), admin=AdminOptions(port=0))
    base = srv.server.admin.address
    a = raw_island(srv.address, "a", SHAPES)
    a.join()
    a.push(rand(), round_=0, kind=pb.PUSH_KIND_INIT)
    real_save = wal.append  # a round's durable write is its log record
    disk = {"full": True}

    def save(*args, **kwargs):
        if disk["full"]:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_save(*args, **kwargs)

    monkeypatch.setattr(wal, "append", save)
    caplog.set_level(logging.INFO, logger="atoll")
    assert a.push(rand(), round_=0, tokens=4).committed
    header, _ = a.pull(0, wait_seconds=1.5)
    assert header.kind == pb.UPDATE_KIND_NOT_READY and header.round == 0
    code, body = http(base + "/healthz")
    assert code == 503 and "No space left on device" in body
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR and "No space left on device" in r.getMessage()]
    assert errors, "no ERROR names the failed save"
    disk["full"] = False
    header, _ = a.pull(0, wait_seconds=20)
    assert header.kind == pb.UPDATE_KIND_DELTA and header.round == 1
    assert http(base + "/healthz")[0] == 200
    assert snapshots.load_live(srv.server.state_dir).round == 1  # its background writer may be pruning


@pytest.mark.timeout(120)
@pytest.mark.skipif(not _mount_namespaces(), reason="needs unshare -m and tmpfs mounts (root)")
def test_a_state_dir_on_a_full_tmpfs_recovers_when_space_returns(tmp_path, raw_island):
    """The coordinator process with its state dir on a 24 MiB tmpfs in a mount namespace of its own;
    the test fills the disk (through /proc/PID/root), a round's save fails with ENOSPC, the daemon
    says so and keeps the round unpublished; the filler goes, the round is published."""
    import os
    import subprocess
    import sys

    state = tmp_path / "state"
    state.mkdir()
    port_file, admin_file = tmp_path / "port", tmp_path / "admin"
    log = open(tmp_path / "coordinator.log", "wb")  # noqa: SIM115 - closed below
    cmd = (
        f"mount -t tmpfs -o size=24m tmpfs {state} && exec {sys.executable} -m atoll coordinator "
        f"--state-dir {state} --run-id t --sync-every 1 --port-file {port_file} --admin-port 0 "
        f"--admin-port-file {admin_file} {' '.join(IDENTITY_FLAGS)}"
    )
    proc = subprocess.Popen(["unshare", "-m", "sh", "-c", cmd], stdout=log, stderr=log)
    try:

        def started():
            assert proc.poll() is None, (tmp_path / "coordinator.log").read_text()
            return port_file.exists() and admin_file.exists()

        wait_for(started, timeout=60, what="the coordinator's port files")
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
        wait_for(lambda: http(admin + "/healthz")[0] == 503, what="/healthz to say the disk is full")
        assert "No space left on device" in http(admin + "/healthz")[1]
        os.unlink(filler)
        header, _ = a.pull(0, wait_seconds=30)
        assert header.kind == pb.UPDATE_KIND_DELTA and header.round == 1
        assert http(admin + "/healthz")[0] == 200
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
        "import sys, atoll.coordinator.run.decider as c\n"
        "def broken(*a, **k):\n"
        "    raise RuntimeError('a bug in decide')\n"
        "c.decide = broken\n"
        "from atoll.cli import main\n"
        f"flags = ['--state-dir', r'{tmp_path / 'state'}', '--run-id', 't', *{IDENTITY_FLAGS!r}]\n"
        "sys.exit(main(['coordinator', *flags]))\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        # No θ yet: the decider does not decide. Bootstrap one island to wake it.
        out = proc.stdout.readline()
        address = out.strip().rsplit(" ", 1)[-1]
        from support import RawIsland

        a = RawIsland(address, "a", {"w": (2, 2)})
        a.join()
        a.push({"w": torch.zeros(2, 2)}, round_=0, kind=pb.PUSH_KIND_INIT)
        a.close()
        assert proc.wait(30) == 1
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stdout.close()
    with proc.stderr:
        err = proc.stderr.read()
    assert "background task atoll-decider died" in err and "a bug in decide" in err


def test_a_second_coordinator_or_a_rollback_on_a_live_state_dir_is_refused_naming_the_holder(
    start_server, tmp_path, capsys
):
    """(Before: a second coordinator on the same --state-dir started and both wrote the same snapshot
    files; `atoll rollback` on a live run returned 0 and the coordinator undid it at its next save.)"""
    import os

    from atoll import cli

    state = tmp_path / "live"
    srv = start_server(state_dir=state)
    second = ServerThread(exact_config(run_id="t", sync_every=1), state)
    with pytest.raises(snapshots.StateError, match=rf"in use by process {os.getpid()}"):
        second.start()
    assert second.loop.is_closed()  # a server that failed to start leaves no loop behind
    assert cli.main(["rollback", "--state-dir", str(state), "--round", "0"]) == 1
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("atoll rollback: error: ") and f"in use by process {os.getpid()}" in err, err
    assert srv.inspect(lambda s: s.round) == 0  # the live coordinator was not disturbed


def test_the_state_dir_lock_cannot_be_deleted_from_under_a_live_coordinator(start_server, tmp_path):
    """Deleting STATE_DIR/.lock while a coordinator ran let a second one start on the same dir: the
    lock is now held on the state dir itself."""
    import os

    state = tmp_path / "live"
    srv = start_server(state_dir=state)
    (state / lock.LOCK).unlink()
    second = ServerThread(exact_config(run_id="t", sync_every=1), state)
    with pytest.raises(snapshots.StateError, match="in use by"):
        second.start()
    with pytest.raises(snapshots.StateError, match="in use by"):
        lock.StateLock(state).acquire("rolling it back")
    assert srv.inspect(lambda s: s.round) == 0
    srv.stop()
    lock.StateLock(state).acquire("rolling it back").release()  # the holder let go: free again
    assert os.path.isdir(state)


@pytest.mark.parametrize("which", ["--port", "--bulk-port", "--admin-port"])
def test_a_second_coordinator_on_a_served_port_fails_at_once_naming_it(start_server, tmp_path, which):
    """A second `atoll coordinator` on the port a running one serves (another state dir, the same run
    id) started without complaint (gRPC's SO_REUSEPORT), and islands divided between the two, each
    building its own θ_0. It now fails at once with one line naming the port; so for the bulk and the
    admin ports."""
    import subprocess
    import sys

    srv = start_server(state_dir=tmp_path / "first", admin=AdminOptions(port=0))
    port = {"--port": srv.server.port, "--bulk-port": srv.server.bulk.port, "--admin-port": srv.server.admin.port}
    cmd = [sys.executable, "-m", "atoll", "coordinator", "--state-dir", str(tmp_path / "second"), "--run-id", "t"]
    flags = {"--port": "0", "--bulk-port": "0", "--admin-port": "0", which: str(port[which])}
    done = subprocess.run(cmd + [x for kv in flags.items() for x in kv], capture_output=True, text=True, timeout=30)
    lines = [x for x in done.stderr.strip().splitlines() if " INFO " not in x]
    assert done.returncode != 0 and "Traceback" not in done.stderr, done.stderr
    assert len(lines) == 1 and str(port[which]) in lines[0] and "in use" in lines[0], done.stderr
    assert srv.inspect(lambda s: s.round) == 0  # the first one goes on
