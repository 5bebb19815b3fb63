"""A closed round's record: typed and versioned; every record stored so far still loads, unknown keys
kept; it reads as the untyped records did."""

from __future__ import annotations

import json

import pytest
import torch
from support import exact_config

from atoll.coordinator.disk import snapshots
from atoll.coordinator.run.run_state import RunState
from atoll.coordinator.state.record import RECORD_VERSION, RoundRecord


def test_a_record_is_typed_and_its_stored_form_says_its_version():
    rec = RoundRecord(round=3, islands=["a"], tokens=8, loss=2.5, reason="all committed", share=0.5)
    stored = rec.to_json()
    assert stored["version"] == RECORD_VERSION == 1 and stored["share"] == 0.5 and "persist_seconds" not in stored
    assert json.loads(json.dumps(stored)) == stored
    back = RoundRecord.from_json(stored)
    assert back == rec and back.version == RECORD_VERSION
    rec.persist_seconds = 0.25  # set once the round is durable: in the snapshots' copy, not in its own log record
    assert rec.to_json()["persist_seconds"] == 0.25


def test_a_record_of_an_earlier_release_loads_and_keeps_what_this_one_does_not_know():
    old = {"round": 0, "islands": ["a", "b"], "tokens": 4, "loss": None, "reason": "r", "seconds_open": 1.5,
           "experimental_field": [1, 2]}  # fmt: skip
    rec = RoundRecord.from_json(old)
    assert rec.version == 0 and rec.islands == ["a", "b"] and rec.tokens_by_island == {} and rec.goodput is None
    assert rec.extra == {"experimental_field": [1, 2]}
    again = rec.to_json()
    assert again["experimental_field"] == [1, 2] and again["version"] == RECORD_VERSION
    with pytest.raises(ValueError, match="without its round"):
        RoundRecord.from_json({"tokens": 1})


def test_it_reads_as_the_untyped_records_did():
    rec = RoundRecord(round=1, islands=["a"], tokens=5, extra={"note": "x"})
    assert rec["tokens"] == 5 and rec.get("loss") is None and rec["note"] == "x"
    assert "share" not in rec and rec.get("share", 7) == 7  # unset optional fields are absent, as before
    with pytest.raises(KeyError):
        rec["extra"]
    assert dict(rec)["islands"] == ["a"] and set(dict(rec)) == set(rec.to_json())


def test_a_state_dir_whose_records_are_of_an_earlier_release_restores_typed(tmp_path):
    """A snapshot written before the records were typed (no version, fewer keys) restores, and the
    restored run's history holds typed records."""
    history = [{"round": 0, "islands": ["a"], "tokens": 3, "loss": 1.25}]
    snap = snapshots.Snapshot(
        exact_config(run_id="t"), 1, {"w": torch.zeros(3)}, {"momentum/w": torch.zeros(3)}, {}, history
    )
    snapshots.save(tmp_path / "state", snap, keep=None)
    state = RunState(exact_config(run_id="t"), tmp_path / "state")
    try:
        assert state.restore()
        (rec,) = state.history
        assert isinstance(rec, RoundRecord) and rec.version == 0 and rec.tokens == 3 and rec.loss == 1.25
        assert state.ledger.loss_of(0) == 1.25 and state.ledger.committed_before("a", 0)
    finally:
        state.close()
