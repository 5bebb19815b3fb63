"""Island side: the DiLoCo wrapper and the coordinator client."""

from atoll.islands.client import CoordinatorClient, RetryPolicy
from atoll.islands.diloco import DiLoCo, RoundStats

__all__ = ["CoordinatorClient", "DiLoCo", "RetryPolicy", "RoundStats"]
