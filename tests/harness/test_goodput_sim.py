"""benchmarks/goodput_sim.py: the discrete-event simulation that drives the coordinator's decision
functions; its arithmetic on cases with a known answer, and the ordering it reports."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from goodput_sim import Setup, Sim  # noqa: E402


@pytest.mark.parametrize("policy", ["barrier", "elastic", "decoupled"])
def test_equal_speeds_no_sync_time_and_no_failures_waste_nothing(policy):
    """Every island computes 300 s rounds back to back: 36 rounds in 3 h, every second into θ."""
    setup = Setup(islands=8, mtbf_seconds=1e12, hours=3.0, speed_sigma=0.0, sync_seconds=0.0)
    got = Sim(setup, policy).run()
    assert got["rounds"] == 36 and got["goodput"] == pytest.approx(1.0) and got["dropped"] == 0


def test_failures_and_a_speed_spread_cost_the_barrier_and_not_the_decoupled_loop():
    setup = dict(islands=64, mtbf_seconds=3600.0, hours=6.0)
    barrier = Sim(Setup(**setup), "barrier").run()
    decoupled = Sim(Setup(**setup), "decoupled").run()
    up = 3600 / (3600 + Setup.repair_seconds)
    assert barrier["failures"] == decoupled["failures"] > 300  # the same seeded failures
    assert barrier["goodput"] < 0.65 < 0.85 < decoupled["goodput"] < up
    assert decoupled["folded"] > 0 and decoupled["dropped"] == 0
