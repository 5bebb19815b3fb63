"""Snapshots on disk: kept, verified, rolled back; what counts as a fresh state dir."""

from __future__ import annotations

import pytest
import torch
from support import exact_config

from atoll.coordinator.disk import lock, snapshots


# ---- persistence --------------------------------------------------------------------------------
def snap(round_: int) -> snapshots.Snapshot:
    params = {"w": torch.full((3, 2), float(round_))}
    history = [{"round": i} for i in range(round_)]
    return snapshots.Snapshot(
        exact_config(run_id="p"),
        round_,
        params,
        {"momentum/w": torch.zeros(3, 2)},
        {},
        history,
    )


def test_snapshots_are_kept_verified_and_rolled_back(tmp_path):
    for r in range(4):
        snapshots.save(tmp_path, snap(r), keep=2)
    assert [snapshots.read_round(p) for p in snapshots.snapshot_paths(tmp_path)] == [2, 3]
    assert snapshots.load(tmp_path).round == 3
    snapshots.rollback(tmp_path, 2)
    assert snapshots.load(tmp_path).round == 2 and len(list((tmp_path / "discarded").rglob("*.safetensors"))) == 1
    with pytest.raises(snapshots.StateError, match="kept rounds: 2"):
        snapshots.rollback(tmp_path, 0)


def test_an_empty_or_foreign_dir_is_a_fresh_run_but_a_dir_of_atoll_leftovers_is_not(tmp_path):
    assert snapshots.load(tmp_path / "nope") is None
    (tmp_path / "notes.txt").write_text("unrelated")
    assert snapshots.load(tmp_path) is None
    (tmp_path / snapshots.MEMBERSHIP).write_text("{}")
    with pytest.raises(snapshots.StateError, match="no valid snapshot"):
        snapshots.load(tmp_path)


# ---- hardening: metadata, declared sizes, stray files, one writer --------------------------------
def rewrite_metadata(path, **changes):
    """Rewrite a snapshot's metadata fields as an attacker would: tensors and their checksums untouched."""
    import json
    import struct

    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    meta = header["__metadata__"]
    for key, fn in changes.items():
        if fn is None:
            del meta[key]
        else:
            meta[key] = fn(meta[key])
    body = json.dumps(header).encode()
    body += b" " * ((8 - len(body) % 8) % 8)
    path.write_bytes(struct.pack("<Q", len(body)) + body + raw[8 + n :])


def test_rewritten_metadata_is_refused_like_a_flipped_bit(tmp_path):
    """(Before: outer_lr 0.7 -> 7.0 and quorum 9 written into the newest snapshot's config, tensors
    unchanged, started, exported and listed as "ok".)"""
    import json

    path = snapshots.save(tmp_path, snap(1))
    snapshots.verify(path)

    def tamper(config):
        c = json.loads(config)
        c.update(outer_lr=7.0, quorum=9)
        return json.dumps(c, sort_keys=True)

    rewrite_metadata(path, config=tamper)
    with pytest.raises(snapshots.StateError, match="metadata fails its checksum"):
        snapshots.load(tmp_path)
    assert "metadata fails its checksum" in snapshots.list_snapshots(tmp_path)[0][2]


def test_a_snapshot_declaring_a_huge_tensor_is_refused_before_it_is_read(tmp_path):
    """A sparse file declaring a 1 GiB tensor: refused by its checksum, read a block at a time, with
    no allocation of its size. (Before: export and rollback died with a MemoryError traceback, and the
    coordinator allocated the tensor before refusing it.)"""
    import json
    import struct

    from support import run_module_measuring_peak

    numel = 1 << 28
    path = snapshots.save(tmp_path, snap(0))
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    base = max(v["data_offsets"][1] for k, v in header.items() if k != "__metadata__")
    header["param/big"] = {"dtype": "F32", "shape": [numel], "data_offsets": [base, base + 4 * numel]}
    meta = header["__metadata__"]
    digests = json.loads(meta["digests"])
    digests["param/big"] = "12345678"
    meta["digests"] = json.dumps(digests, sort_keys=True)
    from atoll.coordinator.disk.verified import META_DIGEST, metadata_digest

    meta[META_DIGEST] = metadata_digest(meta)
    body = json.dumps(header).encode()
    body += b" " * ((8 - len(body) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(body)) + body + raw[8 + n :])
        f.truncate(8 + len(body) + base + 4 * numel)  # sparse: 1 GiB declared, nothing on disk
    code, _, stderr, peak_kib = run_module_measuring_peak(
        "atoll", ["export", "--state-dir", str(tmp_path), "--out", str(tmp_path / "m.st")], timeout=120
    )
    assert code == 1 and "Traceback" not in stderr, stderr
    assert "tensor param/big fails its checksum" in stderr.strip().splitlines()[-1]
    assert peak_kib < 900 * 1024, f"export peaked at {peak_kib / 1024:.0f} MiB"


def test_a_stray_snapshot_name_is_refused_naming_the_file(tmp_path):
    snapshots.save(tmp_path, snap(1))
    (tmp_path / "snapshot-zzz.safetensors").write_bytes(b"x")
    with pytest.raises(snapshots.StateError, match=r"holds snapshot-zzz\.safetensors, which is not a snapshot"):
        snapshots.load(tmp_path)


def test_one_writer_per_state_dir_and_the_lock_goes_with_its_holder(tmp_path):
    import os

    first = lock.StateLock(tmp_path).acquire("starting a coordinator on it")
    with pytest.raises(snapshots.StateError, match=rf"in use by process {os.getpid()} .*stop it before rolling"):
        lock.StateLock(tmp_path).acquire("rolling it back")
    first.release()
    lock.StateLock(tmp_path).acquire("rolling it back").release()


def test_a_format_2_snapshot_without_a_metadata_checksum_still_loads(tmp_path):
    """Snapshots written before the metadata checksum existed (format 2) are read; new ones carry it."""
    from atoll.coordinator.disk.verified import META_DIGEST

    path = snapshots.save(tmp_path, snap(2))
    rewrite_metadata(path, format=lambda _: "atoll-state-2", **{META_DIGEST: None})
    assert snapshots.load(tmp_path).round == 2
    rewrite_metadata(path, format=lambda _: snapshots.FORMAT)
    with pytest.raises(snapshots.StateError, match="metadata has no checksum"):
        snapshots.load(tmp_path)
