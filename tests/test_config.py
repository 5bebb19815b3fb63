"""RunConfig: a restored run's reconciliation with the command line, and operational changes."""

from __future__ import annotations

import pytest

from atoll.coordinator.config import ConfigMismatch, RunConfig, apply_operational, reconcile


# ---- config -----------------------------------------------------------------------------------
def test_reconcile_applies_operational_fields_and_refuses_math_changes():
    stored = RunConfig(run_id="r", quorum=2, codec="int8", outer_lr=0.7)
    asked = RunConfig(run_id="r", quorum=1, codec="int8", outer_lr=0.7, round_deadline_seconds=60.0)
    config, changes = reconcile(stored, asked, frozenset({"run_id", "quorum", "codec"}))
    assert config.quorum == 1 and config.round_deadline_seconds == 600.0  # not given: the stored value
    assert changes == ["quorum: 2 -> 1"]
    with pytest.raises(
        ConfigMismatch, match=r"outer_lr \(run: 0.7, asked: 0.5\); codec \(run: 'int8', asked: 'identity'\)"
    ):
        reconcile(stored, RunConfig(run_id="r", codec="identity", outer_lr=0.5), frozenset({"codec", "outer_lr"}))
    with pytest.raises(ConfigMismatch, match="holds run 'r', not 'x'"):
        reconcile(stored, RunConfig(run_id="x"), frozenset({"run_id"}))


def test_apply_operational_checks_names_and_types():
    c = RunConfig()
    assert apply_operational(c, {"quorum": 3.0})[0].quorum == 3
    for bad in ({"codec": "int8"}, {"quorum": "2"}, {"quorum": True}, {"quorum": 0}):
        with pytest.raises(ValueError):
            apply_operational(c, bad)
