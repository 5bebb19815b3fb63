"""Where the state is kept: one interface, a local dir or an object store, built once from --state-dir."""

from __future__ import annotations

from pathlib import Path

import pytest

from atoll.coordinator.disk import wal
from atoll.coordinator.disk.store import LocalState, ObjectState
from atoll.coordinator.main import where_state_lives


def test_a_local_state_dir_is_its_own_store_and_every_step_past_writing_it_is_nothing(tmp_path):
    state_dir, kept = where_state_lives(tmp_path / "state")
    assert state_dir == tmp_path / "state" and isinstance(kept, LocalState)
    assert kept.url is None and kept.trouble is None and kept.child("fragment-0") is kept
    kept.check(state_dir)
    kept.open(state_dir, "run")
    assert kept.stream_record(wal.record_rel(3), 100) is None
    kept.put_record(state_dir / wal.record_rel(3))
    kept.sync()
    kept.sync_later()
    kept.close()


def test_an_object_store_url_makes_its_working_copy_and_a_store_that_must_be_opened(tmp_path):
    pytest.importorskip("boto3")
    lost = []
    state_dir, kept = where_state_lives("s3://bucket/run", tmp_path / "w", lease_seconds=4.0, on_lost=lost.append)
    assert state_dir == Path(tmp_path / "w") and isinstance(kept, ObjectState)
    assert kept.url == "s3://bucket/run" and kept.lease_seconds == 4.0 and kept.on_lost == lost.append
    frag = kept.child("fragment-1")
    assert frag.url == "s3://bucket/run/fragment-1" and frag.lease_seconds == 4.0
    assert kept.trouble is None  # nothing taken yet, nothing in trouble
    with pytest.raises(RuntimeError, match=r"not open \(ObjectState.open\)"):
        kept.put_record(state_dir / wal.record_rel(0))
    kept.close()  # (closing what was never opened is nothing)


def test_the_logs_layout_is_said_once_and_the_mirror_asks_it():
    assert wal.record_rel(7) == "log/round-00000007.safetensors"
    assert wal.is_record(wal.record_rel(7)) and wal.is_record("log/round-123456789.safetensors")
    assert not wal.is_record("log/optimizer-00000007.safetensors")
    assert not wal.is_record("round-00000007.safetensors") and not wal.is_record("x/log/round-00000007.safetensors")
