"""The object store's working copy is the coordinator's own marked cache (hardening round 5, items 1,
2, 6, 12, 13): a dir that is not one is refused untouched; a cache is reconciled against the store by
content, never by size; a wiped store is refused, not restarted over; nothing but the run's own
canonical names is fetched or read; a live run's export reads a consistent set."""

from __future__ import annotations

import json
import logging

import pytest
import torch
from support import exact_config
from support.stores import run_rounds, state_of

from atoll.cli import main as cli_main
from atoll.compression import codec_of
from atoll.compression.wire import SEALED_DIGEST, unpack
from atoll.coordinator.disk import snapshots, wal, workcopy
from atoll.coordinator.disk.snapshots import StateError
from atoll.coordinator.disk.store import ObjectState
from atoll.coordinator.disk.verified import META_DIGEST, TRAILERS, header_bytes, header_of
from atoll.coordinator.options import StorageOptions
from atoll.objects import Missing, ObjectStore, StoreError

pytestmark = pytest.mark.usefixtures("s3_server")


def files_of(d):
    return {p.relative_to(d).as_posix(): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


def same_state(a, b) -> bool:
    return a[0] == b[0] and all(torch.equal(a[1][k], b[1][k]) for k in a[1])


def test_a_local_runs_state_dir_is_refused_untouched(s3_url, start_server, tmp_path):
    """Pointed at an existing local run's state dir (with an unrelated file in it), a store-backed
    coordinator refuses with one line and leaves every file as it was (it deleted all of them)."""
    local = tmp_path / "local-run"
    srv = start_server(exact_config(run_id="t", sync_every=2), local)
    run_rounds(srv, 2)
    srv.stop()
    (local / "notes.txt").write_text("mine")
    before = files_of(local)
    with pytest.raises(StoreError, match=r"is not a working copy of s3://.*give --work-dir a new or empty dir") as err:
        start_server(exact_config(run_id="t", sync_every=2), local, store=ObjectState(ObjectStore.from_url(s3_url)))
    assert "\n" not in str(err.value)
    assert files_of(local) == before
    assert ObjectStore.from_url(s3_url).listing() == {}  # (and nothing went to the store: no lease either)


def test_a_working_copy_of_another_store_is_refused(s3_url, start_server, tmp_path):
    config = exact_config(run_id="t", sync_every=2)
    work = tmp_path / "w"
    srv = start_server(config, work, store=ObjectState(ObjectStore.from_url(s3_url), lease_seconds=5.0))
    run_rounds(srv, 1)
    srv.stop()
    before = files_of(work)
    with pytest.raises(StoreError, match=rf"is the working copy of {s3_url}, not of {s3_url}-other"):
        start_server(config, work, store=ObjectState(ObjectStore.from_url(s3_url + "-other")))
    assert files_of(work) == before


def test_a_wiped_store_is_refused_naming_both_and_restored_from_the_copy(s3_url, start_server, tmp_path, capsys):
    """The store loses the run (wiped) while the machine keeps its working copy: a start is refused with a
    line naming the store and the copy and how to put it back (it deleted the copy's snapshot and head
    and was then refused forever); `atoll restore-store` puts it back, and the run resumes bitwise."""
    store = ObjectStore.from_url(s3_url)
    config = exact_config(run_id="t", sync_every=2, outer_momentum=0.9)
    work = tmp_path / "w"
    srv = start_server(
        config, work, store=ObjectState(store, lease_seconds=5.0), storage=StorageOptions(snapshot_every=2)
    )
    run_rounds(srv, 5)
    before = state_of(srv)
    srv.stop()
    for rel in store.listing():
        store.delete(rel)
    kept = files_of(work)
    with pytest.raises(StoreError) as err:
        start_server(config, work, store=ObjectState(store, lease_seconds=5.0))
    line = str(err.value)
    assert f"{s3_url} holds no run, but its working copy {work} holds run t up to round 5" in line
    assert f"atoll restore-store --from {work} --state-dir {s3_url}" in line
    assert files_of(work) == kept
    assert cli_main(["restore-store", "--from", str(work), "--state-dir", s3_url]) == 0
    assert "put run t (round 5)" in capsys.readouterr().out
    assert cli_main(["restore-store", "--from", str(work), "--state-dir", s3_url]) == 1  # never over a run
    assert "holds a run already" in capsys.readouterr().err
    again = start_server(config, work, store=ObjectState(store, lease_seconds=5.0))
    assert same_state(before, state_of(again))


def test_a_same_size_record_or_a_damaged_file_is_fetched_again_from_the_store(s3_url, start_server, tmp_path):
    """A working-copy record of the same size as the store's, but another update (a valid record: every
    checksum holds), and a snapshot with a flipped byte: both are fetched again from the intact store, and
    θ is the store's (the record was trusted by its size: θ then differed from the islands')."""
    store = ObjectStore.from_url(s3_url)
    config = exact_config(run_id="t", sync_every=2)
    work = tmp_path / "w"
    srv = start_server(
        config, work, store=ObjectState(store, lease_seconds=5.0), storage=StorageOptions(snapshot_every=100)
    )
    run_rounds(srv, 5)
    before = state_of(srv)
    srv.stop()

    path = work / wal.LOG / wal.record_name(3)
    rec = wal.read(path)
    forged = {}
    for name, payload in rec.payloads.items():
        t = torch.zeros(unpack(payload).shape)
        codec_of(payload).add_decoded_(payload, t)
        forged[name] = codec_of(payload).encode(t + 1.0)
    head, _ = header_of(path)  # the record's own header, with the forged payloads' trailers, at its size
    meta = json.loads(head[8:])["__metadata__"]
    meta = {k: v for k, v in meta.items() if k not in ("digests", META_DIGEST)}
    tensors = {wal.UPDATE + k: p for k, p in forged.items()}
    if TRAILERS in meta:
        meta[TRAILERS] = json.dumps({k: bytes(p[-4:]).hex() for k, p in tensors.items()})
    digests = dict.fromkeys(tensors, f"{SEALED_DIGEST:08x}")
    other = header_bytes(tensors, meta, digests, size=len(head)) + b"".join(bytes(p) for p in tensors.values())
    assert len(other) == path.stat().st_size and other != path.read_bytes()
    path.write_bytes(other)
    wal.read(path)  # (a record every checksum of which holds)
    snap = work / snapshots.snapshot_name(0)
    data = bytearray(snap.read_bytes())
    data[-3] ^= 0xFF
    snap.write_bytes(bytes(data))

    again = start_server(config, work, store=ObjectState(store, lease_seconds=5.0))
    assert same_state(before, state_of(again))
    again.stop()
    assert path.read_bytes() == store.get(f"{wal.LOG}/{wal.record_name(3)}")[0]


def test_only_the_runs_own_names_are_fetched(s3_url, start_server, tmp_path, caplog):
    """A stray object (a large one) and a record under a second name for its round (9 digits) are left in
    the store, named in a warning: they were fetched, and the stray record replaced the real one."""
    store = ObjectStore.from_url(s3_url)
    config = exact_config(run_id="t", sync_every=2)
    srv = start_server(
        config,
        tmp_path / "w1",
        store=ObjectState(store, lease_seconds=5.0),
        storage=StorageOptions(snapshot_every=100),
    )
    run_rounds(srv, 4)
    before = state_of(srv)
    srv.stop()
    store.put_bytes("junk/big.bin", b"x" * (4 << 20))
    real = store.get(f"{wal.LOG}/{wal.record_name(1)}")[0]
    forged = bytearray(store.get(f"{wal.LOG}/{wal.record_name(2)}")[0])
    store.put_bytes(f"{wal.LOG}/round-000000001.safetensors", bytes(forged))
    assert forged != real
    with caplog.at_level(logging.WARNING, logger="atoll.coordinator"):
        again = start_server(config, tmp_path / "w2", store=ObjectState(store, lease_seconds=5.0))
    assert same_state(before, state_of(again))
    again.stop()
    fetched = files_of(tmp_path / "w2")
    assert "junk/big.bin" not in fetched and "log/round-000000001.safetensors" not in fetched
    assert "holds 2 objects that are not the run's files (junk/big.bin, log/round-000000001.safetensors)" in caplog.text


def test_a_stray_name_in_a_local_state_dir_is_refused(start_server, tmp_path):
    """On a local disk a second name for a round's record or snapshot is refused with one line, never
    read in place of the real one."""
    local = tmp_path / "s"
    srv = start_server(exact_config(run_id="t", sync_every=2), local, storage=StorageOptions(snapshot_every=2))
    run_rounds(srv, 3)
    srv.stop()
    assert snapshots.load(local).round == 3
    records = wal.records(local)
    stray = local / wal.LOG / f"round-0{records[-1][1].name[len('round-') :]}"
    stray.write_bytes(records[0][1].read_bytes())
    with pytest.raises(StateError, match=r"holds round-0+\d\.safetensors, which is not a log file's name"):
        snapshots.load(local)
    stray.unlink()
    newest = snapshots.snapshot_paths(local)[-1]
    (local / f"snapshot-0{newest.name[len('snapshot-') :]}").write_bytes(newest.read_bytes())
    with pytest.raises(StateError, match="which is not a snapshot name"):
        snapshots.load(local)


def test_a_live_runs_listing_is_read_again_when_an_object_goes_meanwhile(s3_url, tmp_path, monkeypatch):
    """`atoll export` of a live run: an object pruned between the listing and its download (NoSuchKey, in
    6 of 6 attempts) has the listing read again, and the copy is the newer set."""
    store = ObjectStore.from_url(s3_url)
    (tmp_path / "src").mkdir()
    for rel in ("head.json", f"{wal.LOG}/{wal.record_name(1)}", f"{wal.LOG}/{wal.record_name(2)}"):
        store.put_bytes(rel, b"{}" if rel == "head.json" else b"r" * 100)
    real = ObjectStore.download
    pruned = []

    def pruning(self, rel, path):
        if rel.endswith(wal.record_name(1)) and not pruned:
            pruned.append(rel)
            self.delete(rel)  # the live coordinator prunes it just now
            raise Missing(f"{rel}: no such object")
        return real(self, rel, path)

    monkeypatch.setattr(ObjectStore, "download", pruning)
    files, _ = workcopy.reconcile(store, tmp_path / "copy")
    assert pruned and sorted(files) == ["head.json", f"{wal.LOG}/{wal.record_name(2)}"]
    assert sorted(files_of(tmp_path / "copy")) == [workcopy.MARK, "head.json", f"{wal.LOG}/{wal.record_name(2)}"]
