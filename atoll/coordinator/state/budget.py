"""The bytes the coordinator holds room for, and each transfer's share of them, reserved before its
data flows: the pushes' in-flight budget (declared at a push's header) and the pulls' (what an answer
holds while it streams)."""

from __future__ import annotations

from atoll.coordinator.errors import Reason, refuse


class InflightBudget:
    """Bytes of memory the coordinator holds room for. The pushes': payloads declared by admitted streams
    (reserved at their header), or staged for an island's other ranks; the pulls': what their answers
    hold while they stream. A reservation past ``limit`` is refused (``reason``: INFLIGHT_BUDGET, or
    PULL_BUDGET) before the transfer's data flows: the island retries later."""

    def __init__(self, limit: int, reason: Reason = Reason.INFLIGHT_BUDGET, what: str = "in-flight push") -> None:
        self.limit = limit
        self.used = 0
        self.peak = 0
        self.reason, self.what = reason, what

    def reserve(self, num_bytes: int) -> None:
        if self.used + num_bytes > self.limit:
            raise refuse(
                self.reason,
                f"{self.what} budget spent ({self.used + num_bytes} > {self.limit} bytes); retry shortly",
            )
        self.used += num_bytes
        self.peak = max(self.peak, self.used)

    def release(self, num_bytes: int) -> None:
        self.used -= num_bytes
        if self.used < 0:
            raise AssertionError("in-flight budget released more than it reserved")


class Reservation:
    """One push's share of the budget (its declared bytes, held from its header on); released exactly once."""

    def __init__(self, budget: InflightBudget) -> None:
        self.budget = budget
        self.bytes = 0

    def add(self, num_bytes: int) -> None:
        self.budget.reserve(num_bytes)
        self.bytes += num_bytes

    def release(self) -> None:
        self.budget.release(self.bytes)
        self.bytes = 0
