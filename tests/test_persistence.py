"""Snapshots on disk: kept, verified, rolled back; what counts as a fresh state dir."""

from __future__ import annotations

import pytest
import torch

from atoll.coordinator import persistence
from atoll.coordinator.config import RunConfig


# ---- persistence --------------------------------------------------------------------------------
def snap(round_: int) -> persistence.Snapshot:
    params = {"w": torch.full((3, 2), float(round_))}
    history = [{"round": i} for i in range(round_)]
    return persistence.Snapshot(RunConfig(run_id="p"), round_, params, {"momentum/w": torch.zeros(3, 2)}, {}, history)


def test_snapshots_are_kept_verified_and_rolled_back(tmp_path):
    for r in range(4):
        persistence.save(tmp_path, snap(r), keep=2)
    assert [persistence.read_round(p) for p in persistence.snapshot_paths(tmp_path)] == [2, 3]
    assert persistence.load(tmp_path).round == 3
    persistence.rollback(tmp_path, 2)
    assert persistence.load(tmp_path).round == 2 and len(list((tmp_path / "discarded").rglob("*.safetensors"))) == 1
    with pytest.raises(persistence.StateError, match="kept rounds: 2"):
        persistence.rollback(tmp_path, 0)


def test_an_empty_or_foreign_dir_is_a_fresh_run_but_a_dir_of_atoll_leftovers_is_not(tmp_path):
    assert persistence.load(tmp_path / "nope") is None
    (tmp_path / "notes.txt").write_text("unrelated")
    assert persistence.load(tmp_path) is None
    (tmp_path / persistence.MEMBERSHIP).write_text("{}")
    with pytest.raises(persistence.StateError, match="no valid snapshot"):
        persistence.load(tmp_path)
