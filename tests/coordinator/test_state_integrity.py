"""A coordinator state dir is trusted only after it verifies.

A run makes a real state dir; each test damages a copy the way a disk or an operator would and
runs ``atoll coordinator`` on it (in this process; one case as a real process): it must refuse with
one line, exit non-zero and print no traceback. (Before: a flipped bit, a NaN, a zeroed tensor or an
inconsistent round were loaded and served; a truncated file died with a traceback; a leftover
temporary file started a fresh run.)
"""

from __future__ import annotations

import json
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from support import exact_config

from atoll import cli
from atoll.coordinator.disk import snapshots
from atoll.coordinator.options import StorageOptions
from atoll.protos import coordinator_pb2 as pb

SHAPES = {"w": (64, 32), "b": (32,)}


@pytest.fixture(scope="module")
def made_state(tmp_path_factory):
    """A state dir after bootstrap and three rounds, made by the real server (a snapshot every round:
    the damaged log is tests/coordinator/test_wal.py's)."""
    from support import RawIsland, ServerThread

    state = tmp_path_factory.mktemp("made") / "state"
    srv = ServerThread(exact_config(run_id="t", sync_every=1), state, storage=StorageOptions(snapshot_every=1)).start()
    a = RawIsland(srv.address, "a", SHAPES)
    try:
        a.join()
        a.push({k: torch.randn(s) for k, s in SHAPES.items()}, round_=0, kind=pb.PUSH_KIND_INIT)
        for r in range(3):
            a.push({k: torch.randn(s) * 0.01 for k, s in SHAPES.items()}, round_=r, tokens=8, loss=1.0)
            a.pull(r)
    finally:
        a.close()
        srv.stop()
    return state


def copy_of(made_state, tmp_path) -> Path:
    dest = tmp_path / "state"
    shutil.copytree(made_state, dest)
    return dest


def newest(state: Path) -> Path:
    return sorted(p for p in state.iterdir() if p.name.endswith(".safetensors") and not p.name.startswith("."))[-1]


def tensor_span(path: Path, key: str) -> tuple[int, int]:
    """Byte range of a tensor's data in a safetensors file."""
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    begin, end = json.loads(raw[8 : 8 + n])[key]["data_offsets"]
    return 8 + n + begin, 8 + n + end


def patch(path: Path, offset: int, data: bytes) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data)


def refused_in_process(capsys, state: Path, *extra: str) -> str:
    """``atoll coordinator`` on ``state`` through the CLI's own entry point, in this process: it must
    refuse with one line (the CLI's, no traceback) and exit 1 before it serves anything."""
    code = cli.main(["coordinator", "--state-dir", str(state), "--run-id", "t", "--port", "0", *extra])
    err = capsys.readouterr().err
    assert code == 1 and "Traceback" not in err, err
    return err.strip().splitlines()[-1]


def start(state: Path, *extra: str, timeout: float = 60) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "atoll", "coordinator", "--state-dir", str(state), "--run-id", "t", *extra]
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        pytest.fail("the coordinator started on a damaged state dir instead of refusing it")


def assert_refused(proc: subprocess.CompletedProcess, *words: str) -> str:
    assert proc.returncode != 0, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    for w in words:
        assert w in last, last
    return last


def flip_bit(state):
    path = newest(state)
    lo, _ = tensor_span(path, "param/w")
    byte = path.read_bytes()[lo + 100]
    patch(path, lo + 100, bytes([byte ^ 0x10]))


def nan_in_theta(state):
    path = newest(state)
    lo, _ = tensor_span(path, "param/w")
    patch(path, lo + 4 * 7, struct.pack("<f", float("nan")))


def zero_tensor(state):
    path = newest(state)
    lo, hi = tensor_span(path, "param/b")
    patch(path, lo, bytes(hi - lo))


def round_disagrees_with_history(state):
    from safetensors import safe_open
    from safetensors.torch import save_file

    path = newest(state)
    with safe_open(str(path), framework="pt") as f:
        meta = dict(f.metadata())
        tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
    meta["round"] = str(int(meta["round"]) + 2)
    save_file(tensors, str(path), metadata=meta)


def truncate(state):
    path = newest(state)
    path.write_bytes(path.read_bytes()[:1000])


def garbage(state):
    newest(state).write_bytes(b"not a safetensors file at all" * 10)


DAMAGE = {
    "flipped bit": (flip_bit, "param/w"),
    "NaN in θ": (nan_in_theta, "param/w"),
    "zeroed tensor": (zero_tensor, "param/b"),
    "round vs history": (round_disagrees_with_history, "round"),
    "truncated": (truncate, ""),
    "garbage": (garbage, ""),
}


@pytest.mark.parametrize("case", list(DAMAGE))
def test_damaged_state_is_refused_with_one_line(made_state, tmp_path, case, capsys):
    state = copy_of(made_state, tmp_path)
    damage, word = DAMAGE[case]
    damage(state)
    last = refused_in_process(capsys, state)
    assert last.startswith("atoll coordinator: error: ") and newest(state).name in last and word in last, last


def test_a_damaged_state_stops_the_real_process_with_one_line(made_state, tmp_path):
    state = copy_of(made_state, tmp_path)
    flip_bit(state)
    assert_refused(start(state), newest(state).name, "param/w")


def test_leftover_temporary_file_without_a_snapshot_never_starts_fresh(made_state, tmp_path, capsys):
    state = copy_of(made_state, tmp_path)
    for p in list(state.iterdir()):
        if p.name.endswith(".safetensors"):
            p.rename(state / f".{p.name}.tmp")
    assert "no valid snapshot" in refused_in_process(capsys, state)


def test_state_of_another_run_is_refused(made_state, tmp_path, capsys):
    state = copy_of(made_state, tmp_path)
    last = refused_in_process(capsys, state, "--run-id", "other")
    assert "'t'" in last and "'other'" in last, last


def test_keeps_k_snapshots_and_rolls_back_explicitly(made_state, tmp_path, capsys):
    state = copy_of(made_state, tmp_path)
    rounds = [snapshots.read_round(p) for p in snapshots.snapshot_paths(state)]
    assert rounds == [2, 3]  # --keep-snapshots defaults to 2
    flip_bit(state)
    assert "rollback" in refused_in_process(capsys, state)
    listing = subprocess.run(
        [sys.executable, "-m", "atoll", "rollback", "--state-dir", str(state)], capture_output=True, text=True
    )
    assert listing.returncode == 0 and "round 3" in listing.stdout and "DAMAGED" in listing.stdout
    done = subprocess.run(
        [sys.executable, "-m", "atoll", "rollback", "--state-dir", str(state), "--round", "2"],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr
    snap = snapshots.load(state)
    assert snap.round == 2 and len(snap.history) == 2
    assert (state / "discarded").is_dir()  # the damaged snapshot is kept aside, not deleted


def test_a_verified_snapshot_loads_bitwise(made_state):
    snap = snapshots.load(made_state)
    assert snap.round == 3 and [h["round"] for h in snap.history] == [0, 1, 2]
    assert {k: tuple(v.shape) for k, v in snap.params.items()} == SHAPES
    assert all(torch.isfinite(v).all() for v in snap.params.values())
