"""Island side: the DiLoCo wrapper and the coordinator client."""

from atoll.islands.client import CoordinatorClient, RetryPolicy
from atoll.islands.diloco import DiLoCo
from atoll.islands.errors import CoordinatorRefused, CoordinatorUnreachable
from atoll.islands.flight import RoundStats

__all__ = ["CoordinatorClient", "CoordinatorRefused", "CoordinatorUnreachable", "DiLoCo", "RetryPolicy", "RoundStats"]
