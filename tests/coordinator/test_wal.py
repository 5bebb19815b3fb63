"""The write-ahead log: a round is durable by its small log record before it is
published; the optimizer state and the snapshots are written after, in the background; a restart is
the newest snapshot plus the log replayed, bitwise; a damaged or gapped log is refused, never skipped."""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
import sys
import threading

import pytest
import torch

from atoll import cli
from atoll.coordinator import RunConfig
from atoll.coordinator.disk import snapshots, wal
from atoll.coordinator.options import StorageOptions
from atoll.protos import coordinator_pb2 as pb

SHAPES = {"w": (256, 64), "b": (64,)}
FP32_BYTES = 4 * sum(a * b for a, b in [SHAPES["w"]]) + 4 * 64


def run(state, rounds: int, codec: str = "int8", **options):
    """A real server, two islands, ``rounds`` rounds of ``codec`` up and down (the downlink keeps error
    feedback) with Nesterov momentum; returns the live θ and optimizer state at the end."""
    from support import RawIsland, ServerThread

    config = RunConfig(run_id="t", sync_every=1, quorum=2, codec=codec, downlink_codec=codec)
    srv = ServerThread(config, state, **options).start()
    gen = torch.Generator().manual_seed(0)
    islands = [RawIsland(srv.address, name, SHAPES, codec=codec) for name in ("a", "b")]
    try:
        for i in islands:
            i.join()
        islands[0].push({k: torch.randn(s, generator=gen) for k, s in SHAPES.items()}, round_=0, kind=pb.PUSH_KIND_INIT)
        for r in range(rounds):
            for i in islands:
                i.push({k: torch.randn(s, generator=gen) * 0.01 for k, s in SHAPES.items()}, round_=r, tokens=8)
            islands[0].pull(r)
        live = srv.inspect(lambda st: ({k: v.clone() for k, v in st.model.params.items()}, st.model.state_tensors()))
        live = (live[0], {k: v.clone() for k, v in live[1].items()})
    finally:
        for i in islands:
            i.close()
        srv.stop()
    return live


@pytest.fixture(scope="module")
def logged(tmp_path_factory):
    """Four rounds with no snapshot after θ_0's: the log holds rounds 0-3."""
    state = tmp_path_factory.mktemp("wal") / "state"
    return state, run(state, 4, storage=StorageOptions(snapshot_every=100))


def copy_of(logged, tmp_path):
    dest = tmp_path / "state"
    shutil.copytree(logged[0], dest)
    return dest


def test_a_round_is_made_durable_by_its_small_log_record_and_replays_bitwise(logged):
    state, (params, extra) = logged
    assert [snapshots.read_round(p) for p in snapshots.snapshot_paths(state)] == [0]  # θ_0's only
    assert [r for r, _ in wal.records(state)] == [0, 1, 2, 3]
    assert [r for r, _ in wal.optimizer_files(state)] == [4]
    # What each round wrote before its publish: the int8 update and metadata, ~|θ|/4.
    sizes = [p.stat().st_size for _, p in wal.records(state)]
    assert all(FP32_BYTES / 4 < s < FP32_BYTES / 4 + 8192 for s in sizes), (sizes, FP32_BYTES)
    snap = snapshots.load(state)
    assert snap.round == 4 and [h["round"] for h in snap.history] == [0, 1, 2, 3] and snap.notes == []
    assert set(snap.params) == set(params) and all(torch.equal(snap.params[k], params[k]) for k in params)
    assert set(snap.extra) == set(extra) and all(torch.equal(snap.extra[k], extra[k]) for k in extra)
    assert any(k.startswith("downlink_ef/") and v.abs().sum() > 0 for k, v in extra.items())
    assert set(snap.islands) == {"a", "b"}


def test_a_sparse_downlinks_residual_replays_bitwise_from_the_log(tmp_path):
    """``sparse`` both ways: the coordinator's downlink residual (what its sparse updates have not sent
    yet) is part of the state, so a restart from θ_0's snapshot and the log is the live θ, momentum
    and residual, bitwise; each record holds a sparse update (2.4 KB here, mostly the record's
    metadata, where int8's are over |θ|/4 = 16 KB)."""
    state = tmp_path / "state"
    params, extra = run(state, 4, codec="sparse", storage=StorageOptions(snapshot_every=100))
    snap = snapshots.load(state)
    assert snap.round == 4 and all(torch.equal(snap.params[k], params[k]) for k in params)
    assert set(snap.extra) == set(extra) and all(torch.equal(snap.extra[k], extra[k]) for k in extra)
    residual = {k: v for k, v in extra.items() if k.startswith("downlink_ef/")}
    assert residual and all(v.abs().sum() > 0 for v in residual.values())
    sizes = [p.stat().st_size for _, p in wal.records(state)]
    assert all(s < FP32_BYTES / 16 for s in sizes), (sizes, FP32_BYTES)


def test_snapshots_come_every_k_rounds_and_the_log_is_pruned_behind_them(tmp_path):
    state = tmp_path / "state"
    params, extra = run(state, 5, storage=StorageOptions(snapshot_every=2))
    assert [snapshots.read_round(p) for p in snapshots.snapshot_paths(state)] == [2, 4]
    assert [r for r, _ in wal.optimizer_files(state)] == [5]
    snap = snapshots.load(state)  # snapshot 4 + round 4's record + optimizer-5
    assert snap.round == 5 and all(torch.equal(snap.params[k], params[k]) for k in params)
    assert all(torch.equal(snap.extra[k], extra[k]) for k in extra)


def refused(capsys, state) -> str:
    code = cli.main(["coordinator", "--state-dir", str(state), "--run-id", "t", "--port", "0"])
    err = capsys.readouterr().err
    assert code == 1 and "Traceback" not in err, err
    return err.strip().splitlines()[-1]


def flip_a_bit(path, at: int = -100) -> None:
    raw = bytearray(path.read_bytes())
    raw[at] ^= 0x10
    path.write_bytes(bytes(raw))


def test_a_damaged_log_record_is_refused_naming_it(logged, tmp_path, capsys):
    state = copy_of(logged, tmp_path)
    flip_a_bit(state / "log" / wal.record_name(1))
    last = refused(capsys, state)
    assert "log/round-00000001.safetensors" in last and "checksum" in last and "rollback" in last, last


def test_a_truncated_log_record_is_refused(logged, tmp_path, capsys):
    state = copy_of(logged, tmp_path)
    path = state / "log" / wal.record_name(3)
    path.write_bytes(path.read_bytes()[:5000])
    assert "log/round-00000003.safetensors" in refused(capsys, state)


def test_a_gap_in_the_log_is_refused_never_skipped(logged, tmp_path, capsys):
    state = copy_of(logged, tmp_path)
    (state / "log" / wal.record_name(2)).unlink()
    last = refused(capsys, state)
    assert "no record of round 2" in last, last


def test_a_log_cut_short_behind_its_optimizer_state_is_refused(logged, tmp_path, capsys):
    state = copy_of(logged, tmp_path)
    (state / "log" / wal.record_name(3)).unlink()  # the optimizer state of θ_4 without θ_4's record
    assert "newer than the log" in refused(capsys, state)


@pytest.mark.parametrize("how", ["removed", "replaced by a file", "its newest records removed"])
def test_a_missing_log_is_refused_never_a_silent_rollback(logged, tmp_path, capsys, how):
    """Four rounds published and no snapshot after θ_0's: `rm -r STATE_DIR/log` (or log/ replaced by a
    file) started the run at round 0 with θ_0 and no warning, `atoll export` wrote round 0 and `atoll
    rollback` listed the dir as fine. The dir records the newest round it published (head.json), so a
    restore that reaches less is refused with one line, by the coordinator and by export, and the
    listing says so."""
    state = copy_of(logged, tmp_path)
    if how == "its newest records removed":
        for r in (2, 3):
            (state / "log" / wal.record_name(r)).unlink()
        (state / "log" / wal.optimizer_name(4)).unlink()
    else:
        shutil.rmtree(state / "log")
        if how == "replaced by a file":
            (state / "log").write_text("not a log")
    last = refused(capsys, state)
    assert "round 4" in last and "log" in last and "rollback" in last, last
    assert cli.main(["export", "--state-dir", str(state), "--out", str(tmp_path / "theta.safetensors")]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "round 4" in err[0] and not (tmp_path / "theta.safetensors").exists()
    assert cli.main(["rollback", "--state-dir", str(state)]) == 0
    assert "round 4" in capsys.readouterr().out


def test_a_read_of_a_live_dir_retries_a_file_pruned_under_it_but_not_damage(logged, tmp_path, monkeypatch):
    """``load_live`` (``atoll export``, tests reading a running coordinator's dir): a file the live
    writer prunes between the listing and the read fails one attempt, which is retried; damage fails
    every attempt and is reported."""
    state = copy_of(logged, tmp_path)
    real, calls = snapshots.load, []

    def pruned_once(state_dir, upto=None):
        calls.append(upto)
        if len(calls) == 1:
            raise snapshots.StateError("log/optimizer-00000004.safetensors: No such file or directory")
        return real(state_dir, upto)

    monkeypatch.setattr(snapshots, "load", pruned_once)
    assert snapshots.load_live(state, pause=0).round == 4 and len(calls) == 2
    monkeypatch.setattr(snapshots, "load", real)
    flip_a_bit(state / "log" / wal.record_name(1))
    with pytest.raises(snapshots.StateError, match="round-00000001"):
        snapshots.load_live(state, pause=0)


def test_a_crash_before_the_background_write_keeps_theta_exact_and_says_what_it_lost(logged, tmp_path):
    """Killed between a publish and its background write: θ comes back exactly from the log, the
    optimizer state is the last one on disk, and the restore says so."""
    state = copy_of(logged, tmp_path)
    params, _ = logged[1]
    (state / "log" / wal.optimizer_name(4)).unlink()
    snap = snapshots.load(state)
    assert snap.round == 4 and all(torch.equal(snap.params[k], params[k]) for k in params)
    assert len(snap.notes) == 1 and "round 0's momentum" in snap.notes[0]


def test_a_rollback_sets_the_log_after_it_aside(tmp_path):
    state = tmp_path / "state"
    run(state, 5, storage=StorageOptions(snapshot_every=2))
    done = subprocess.run(
        [sys.executable, "-m", "atoll", "rollback", "--state-dir", str(state), "--round", "2"],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr
    assert [r for r, _ in wal.records(state)] == [0, 1]  # the updates to θ_1, θ_2: kept for catch-ups
    assert wal.optimizer_files(state) == []
    snap = snapshots.load(state)  # the round it published is set back too: the rollback is explicit
    assert snap.round == 2 and len(snap.history) == 2


# ---- the record written while the step makes the update -----------------------------------------
def test_a_record_streamed_during_the_step_is_the_same_record_and_its_failures_fall_back(tmp_path, monkeypatch):
    """Above ``STREAM_MIN_BYTES`` a round's record is written while the outer step makes its update,
    so the save after the step is the header and an fsync. The records replay to the same θ and
    optimizer state bitwise as records written whole; a write that fails falls back to the whole
    write (the round is still durable) and leaves no stray file."""
    whole = run(tmp_path / "whole", 3, storage=StorageOptions(snapshot_every=100))
    monkeypatch.setattr(wal, "STREAM_MIN_BYTES", 0)
    finished, real_finish = [], wal.RecordStream.finish

    def finish(self, *args):
        finished.append(real_finish(self, *args))
        return finished[-1]

    monkeypatch.setattr(wal.RecordStream, "finish", finish)
    streamed = run(tmp_path / "streamed", 3, storage=StorageOptions(snapshot_every=100))
    assert finished == [True, True, True]
    for state in ("whole", "streamed"):
        snap = snapshots.load(tmp_path / state)
        assert snap.round == 3 and snap.notes == []
        got = (snap.params, snap.extra)
        for mine, theirs in zip(got, streamed if state == "whole" else whole, strict=True):
            assert set(mine) == set(theirs) and all(torch.equal(mine[k], theirs[k]) for k in mine)
    for (r1, p1), (r2, p2) in zip(wal.records(tmp_path / "whole"), wal.records(tmp_path / "streamed"), strict=True):
        a, b = wal.read(p1), wal.read(p2)
        assert r1 == r2 and {k: bytes(v) for k, v in a.payloads.items()} == {k: bytes(v) for k, v in b.payloads.items()}
        assert p2.stat().st_size > p1.stat().st_size  # the header's room, padded
    # The writer thread fails (a full disk): written whole.
    finished.clear()
    real_pwrite = os.pwrite

    def pwrite(fd, data, at):
        if threading.current_thread().name == "atoll-record":
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_pwrite(fd, data, at)

    monkeypatch.setattr(os, "pwrite", pwrite)
    run(tmp_path / "full", 2, storage=StorageOptions(snapshot_every=100))
    assert finished == [False, False] and snapshots.load(tmp_path / "full").round == 2
    assert not [p for p in (tmp_path / "full" / wal.LOG).iterdir() if p.name.endswith(".tmp")]


def test_a_streamed_record_whose_header_outgrows_its_room_is_written_whole(tmp_path):
    """The header (history, membership, config) is known only after the step; one larger than the
    room set aside for it makes the record be written whole, with no file of the stream left."""
    from atoll.compression import get_codec

    gen = torch.Generator().manual_seed(0)
    payloads = {k: get_codec("int8").encode(torch.randn(s, generator=gen)) for k, s in SHAPES.items()}
    data = sum(len(p) for p in payloads.values())
    config = RunConfig(run_id="t", sync_every=1)
    for history, streamed in (({"round": 0}, True), ({"round": 0, "notes": "n" * 5000}, False)):
        state = tmp_path / str(streamed)
        stream = wal.RecordStream(state, 0, head_hint=100)  # one 4 KiB block for the header
        for k, p in payloads.items():
            stream.add(k, p)
        done: list[bool] = []
        stream.finish = lambda *a, f=stream.finish, done=done: done.append(f(*a)) or done[-1]
        wal.append(state, 0, payloads, history, {}, config, stream=stream)
        assert done == [streamed]
        [(r, path)] = wal.records(state)
        rec = wal.read(path)
        assert r == 0 and rec.history == history
        assert {k: bytes(v) for k, v in rec.payloads.items()} == {k: bytes(v) for k, v in payloads.items()}
        assert (path.stat().st_size - data == 4096) is streamed  # the header's room, or a header to measure
        assert [p.name for p in (state / wal.LOG).iterdir()] == [path.name]


def test_with_exact_failover_an_optimizer_file_of_a_round_whose_record_never_landed_is_not_state(tmp_path):
    """``--exact-failover`` writes round r's optimizer state (that of θ_{r+1}) before round r's record:
    a coordinator that died between the two leaves the file of a round never published. A restart, or
    a standby starting meanwhile, restores round r open with round r's own optimizer state, bitwise;
    a file two rounds ahead of the log is still damage."""
    state = tmp_path / "state"
    run(state, 3, storage=StorageOptions(snapshot_every=100, exact_failover=True))
    assert [r for r, _ in wal.optimizer_files(state)] == [3]
    expected = snapshots.load(state).extra  # round 3's own optimizer state
    stray = {k: v + 1.0 for k, v in expected.items()}  # what a step of round 3 made, its record never put
    wal.write_optimizer(state, 4, stray, before_record=True)
    snap = snapshots.load(state)
    assert snap.round == 3 and snap.notes == []
    assert all(torch.equal(snap.extra[k], expected[k]) for k in expected)
    (state / "log" / wal.record_name(2)).unlink()
    snapshots.write_head(state, 2)
    with pytest.raises(snapshots.StateError, match="newer than the log"):
        snapshots.load(state)
