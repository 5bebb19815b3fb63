"""Goodput: the island compute-seconds whose tokens entered θ, over the island wall-seconds while
joined. Pure bookkeeping, the same in every mode: a barrier-bound island computes little of its
wall time, and a push that was dropped enters nothing, so both show as a low value."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass


@dataclass
class Goodput:
    joined_at: float
    """Clock time the island joined (or the coordinator restored it)."""
    compute_into_theta: float = 0.0
    """Compute seconds the island reported with pushes that entered θ (committed or folded)."""
    blocked_seconds: float = 0.0
    """Seconds the island reported being blocked on exchanges."""
    tokens_into_theta: int = 0
    left_at: float | None = None
    island: str = ""
    """Whose (a record that left is still shown by name)."""

    def entered(self, compute_seconds: float, blocked_seconds: float, tokens: int) -> None:
        """A push of the island entered θ."""
        self.compute_into_theta += compute_seconds
        self.blocked_seconds += blocked_seconds
        self.tokens_into_theta += tokens

    def wall(self, now: float) -> float:
        return max((self.left_at if self.left_at is not None else now) - self.joined_at, 0.0)

    def ratio(self, now: float) -> float | None:
        """Goodput in 0..1 (None before any wall time passed)."""
        wall = self.wall(now)
        return min(self.compute_into_theta / wall, 1.0) if wall > 0 else None


def run_goodput(islands: list[Goodput], now: float) -> float | None:
    """The run's goodput: every island's compute into θ over every island's wall time while joined."""
    wall = sum(g.wall(now) for g in islands)
    return min(sum(g.compute_into_theta for g in islands) / wall, 1.0) if wall > 0 else None


def tokens_per_step(reports: Iterable[tuple[int, int | None]]) -> float | None:
    """Σ tokens / Σ inner steps over the (tokens, inner steps) reports that give both (None: none do):
    what an island that reports no tokens is weighed per step."""
    both = [(tokens, steps) for tokens, steps in reports if tokens and steps]
    return sum(t for t, _ in both) / sum(s for _, s in both) if both else None
