"""The coordinator daemon: round state machine, outer optimizer, persistence.

In Python: ``CoordinatorServer(RunConfig(...), state_dir, network=NetworkOptions(...), ...)``, its
options typed per concern (:mod:`atoll.coordinator.options`), its state kept in a local dir or an
object store (:class:`ObjectState`)."""

from atoll.coordinator.config import RunConfig
from atoll.coordinator.disk.store import LocalState, ObjectState
from atoll.coordinator.options import (
    AdminOptions,
    CoordinatorOptions,
    LimitsOptions,
    NetworkOptions,
    PlacementOptions,
    SecurityOptions,
    StorageOptions,
)
from atoll.coordinator.transport.server import CoordinatorServer

__all__ = [
    "AdminOptions",
    "CoordinatorOptions",
    "CoordinatorServer",
    "LimitsOptions",
    "LocalState",
    "NetworkOptions",
    "ObjectState",
    "PlacementOptions",
    "RunConfig",
    "SecurityOptions",
    "StorageOptions",
]
