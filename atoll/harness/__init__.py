"""Local multi-process harness: a coordinator and islands as real processes on loopback."""

from atoll.harness.processes import ManagedProcess, ProcessGroup

__all__ = ["ManagedProcess", "ProcessGroup"]
