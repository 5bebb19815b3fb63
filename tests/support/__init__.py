"""What the tests share, as plain functions and classes (the fixtures are in ``tests/conftest.py``).

``from support import exact_config, wait_for, ...`` for the common ones; the others by module."""

from support.processes import (
    IDENTITY_FLAGS,
    collect_events,
    coordinator_flags,
    island_flags,
    run_module_measuring_peak,
)
from support.servers import FakeClock, RawIsland, ServerThread, exact_config, http, post_json, wait_for
from support.training import H, batches, config, inner_step, island, make_diloco, make_model

__all__ = [
    "H",
    "IDENTITY_FLAGS",
    "FakeClock",
    "RawIsland",
    "ServerThread",
    "batches",
    "collect_events",
    "config",
    "coordinator_flags",
    "exact_config",
    "http",
    "inner_step",
    "island",
    "island_flags",
    "make_diloco",
    "make_model",
    "post_json",
    "run_module_measuring_peak",
    "wait_for",
]
