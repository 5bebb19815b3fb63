"""RunConfig: a restored run's reconciliation with the command line, and operational changes."""

from __future__ import annotations

import pytest
from support import exact_config

from atoll.coordinator.config import OPERATIONAL_FIELDS, ConfigMismatch, RunConfig, apply_operational, reconcile


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
        reconcile(stored, exact_config(run_id="x"), frozenset({"run_id"}))


def test_apply_operational_checks_names_and_types():
    c = RunConfig()
    assert apply_operational(c, {"quorum": 3.0})[0].quorum == 3
    for bad in ({"codec": "int8"}, {"quorum": "2"}, {"quorum": True}, {"quorum": 0}):
        with pytest.raises(ValueError):
            apply_operational(c, bad)


# ---- ranges: one place for the command line, the admin API and a restored snapshot -------------
OUT_OF_RANGE = {
    "quorum": [2**31, 1e30, 0],
    "max_staleness": [2**31, 0],
    "total_rounds": [2**63, -1],
    "max_tokens_per_round": [2**64, -1],
    "sync_every": [2**31, 0],
    "max_delta_norm": [float("nan"), float("inf"), -1.0],
    "clip_norm": [float("nan"), float("inf")],
    "round_deadline_seconds": [float("inf"), float("nan"), 0.0],
    "lease_seconds": [float("inf"), 0.0],
    "outer_lr": [float("nan"), float("inf"), 0.0],
    "staleness_weight": [float("nan"), 0.0, 1.5],
    "error_feedback_decay": [float("nan"), 0.0],
}
"""(Before: quorum 2^31 and the like were taken, and every Join then failed "Value out of range" on
RunConfigProto's int32; NaN turned max_delta_norm's bound off.)"""


@pytest.mark.parametrize(("field", "value"), [(f, v) for f, vs in OUT_OF_RANGE.items() for v in vs])
def test_a_setting_outside_its_range_is_refused_naming_the_field_and_range(field, value):
    with pytest.raises(ValueError, match=rf"^{field} must be in [\[(].*, got"):
        RunConfig(**{field: value})
    if field in OPERATIONAL_FIELDS:
        with pytest.raises(ValueError, match=rf"^{field} must be in"):
            apply_operational(RunConfig(), {field: value})


def test_every_value_in_range_fits_the_wire_message():
    from atoll.coordinator.config import RANGES
    from atoll.coordinator.transport.convert import config_proto

    for name, (low, high, low_in, high_in) in RANGES.items():
        for value in (low if low_in else None, high if high_in else None):
            if value is not None:
                config_proto(RunConfig(**{name: value})).SerializeToString()  # no "Value out of range"


def test_a_snapshot_holding_an_out_of_range_setting_is_refused(tmp_path):
    import dataclasses

    import torch

    from atoll.coordinator.disk import snapshots

    bad = RunConfig()
    object.__setattr__(bad, "quorum", 2**31)  # as if written by an older build or by hand
    params = {"w": torch.zeros(2)}
    snap = snapshots.Snapshot(bad, 0, params, {"momentum/w": torch.zeros(2)})
    snapshots.save(tmp_path, snap)
    with pytest.raises(snapshots.StateError, match="quorum must be in"):
        snapshots.load(tmp_path)
    assert dataclasses.asdict(bad)["quorum"] == 2**31


def test_a_run_saved_before_the_decoupled_share_keeps_its_full_step():
    """A stored config without ``decoupled_step`` (a run from before it) loads with the rule it ran under,
    "full": a restart must not change a decoupled run's math (a new run's default is "spread"); one
    saved with "delayed", "whole", "progress" or "even" keeps it."""
    import json

    from atoll.coordinator.config import RunConfig

    old = json.loads(RunConfig(run_id="r", outer_mode="decoupled").to_json())
    del old["decoupled_step"]
    assert RunConfig.from_json(json.dumps(old)).decoupled_step == "full"
    assert RunConfig(run_id="r").decoupled_step == "spread"
    assert RunConfig.from_json(RunConfig(run_id="r").to_json()).decoupled_step == "spread"
    assert RunConfig.from_json(RunConfig(run_id="r", decoupled_step="progress").to_json()).decoupled_step == "progress"
    assert RunConfig.from_json(RunConfig(run_id="r", decoupled_step="even").to_json()).decoupled_step == "even"
    assert RunConfig.from_json(RunConfig(run_id="r", decoupled_step="whole").to_json()).decoupled_step == "whole"
    assert RunConfig.from_json(RunConfig(run_id="r", decoupled_step="delayed").to_json()).decoupled_step == "delayed"
    assert RunConfig.from_json(RunConfig(run_id="r", decoupled_step="share").to_json()).decoupled_step == "share"
    with pytest.raises(ValueError, match="decoupled_step"):
        RunConfig(run_id="r", decoupled_step="half")


def test_a_run_that_names_no_downlink_gets_sparse_for_sparse_pushes_and_int8_otherwise():
    """(Before: int8 down whatever went up: a sparse run pulled |θ|/4 every round.) The rule is stored
    resolved, so a restart that names no downlink either finds the same run."""
    from atoll.coordinator import RunConfig

    assert RunConfig().downlink_codec == "int8" and RunConfig(codec="identity").downlink_codec == "int8"
    sparse = RunConfig(codec="sparse")
    assert sparse.downlink_codec == "sparse:density=0.03125,bits=2,chunk=4096"
    assert RunConfig(codec="sparse:density=0.004,bits=3").downlink_codec == "sparse:density=0.016,bits=3,chunk=4096"
    assert RunConfig(codec="sparse", downlink_codec="int8").downlink_codec == "int8"
    assert RunConfig.from_json(sparse.to_json()) == sparse
    with pytest.raises(ValueError, match="codec: unknown codec 'nope'"):
        RunConfig(codec="nope")
