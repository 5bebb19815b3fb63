"""The coordinator daemon: round state machine, outer optimizer, persistence."""

from atoll.coordinator.config import RunConfig
from atoll.coordinator.transport.server import CoordinatorServer

__all__ = ["CoordinatorServer", "RunConfig"]
