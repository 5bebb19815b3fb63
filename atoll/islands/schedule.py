"""When each coordinator link is due to sync, and what its round has counted so far.

Plain DiLoCo: every link after H inner steps. Streaming (fragments): link p first after
⌈(p+1)·H/P⌉ steps, then every H, so each sync moves about 1/P of the model. Time budget
(``sync_every_seconds``): every link once the budget since its last sync is spent.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass
class LinkCount:
    """One link's round so far."""

    first_sync: int = 0
    """Inner steps before this link's first sync (streaming staggers them); later ones every H."""
    steps: int = 0
    tokens: int = 0
    losses: list[float] = field(default_factory=list)
    started: float = 0.0
    """Clock time the round started (the time budget counts from here)."""
    pushed: int = 0
    """Rounds this link pushed since start()."""
    blocked: float = 0.0
    """Seconds the island was blocked on exchanges since this link's round started."""
    carried: tuple[int, int, float] = (0, 0, 0.0)
    """(steps, island tokens, compute seconds) of a dropped push whose progress the next push carries."""

    def compute_seconds(self, now: float) -> float:
        """The island's compute time in this round: its wall time since the round started, less the
        time it was blocked on exchanges meanwhile (the coordinator's goodput counts it)."""
        return max(now - self.started - self.blocked, 0.0)

    def mean_loss(self) -> float | None:
        return sum(self.losses) / len(self.losses) if self.losses else None

    def restart(self, now: float) -> None:
        self.steps, self.tokens, self.losses, self.started, self.blocked = 0, 0, [], now, 0.0
        self.carried = (0, 0, 0.0)
        self.pushed += 1

    def carry(self, steps: int, tokens: int, compute_seconds: float) -> None:
        """A push of this link was dropped; its work stays in θ and goes with the next push."""
        s, t, c = self.carried
        self.carried = (s + steps, t + tokens, c + compute_seconds)

    def state_dict(self) -> dict:
        return {
            "steps": self.steps,
            "tokens": self.tokens,
            "losses": list(self.losses),
            "pushed": self.pushed,
            "carried": list(self.carried),
        }

    def load_state_dict(self, sd: dict) -> None:
        self.steps, self.tokens, self.losses = int(sd["steps"]), int(sd["tokens"]), list(sd["losses"])
        self.pushed = int(sd["pushed"])
        s, t, c = sd.get("carried", (0, 0, 0.0))  # absent in checkpoints of older releases
        self.carried = (int(s), int(t), float(c))


class Schedule:
    def __init__(
        self,
        num_links: int,
        *,
        streaming: bool,
        sync_every_seconds: float | None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.num_links = num_links
        self.streaming = streaming
        self.sync_every_seconds = sync_every_seconds
        self.clock = clock
        self.sync_every = 0
        self.links = [LinkCount() for _ in range(num_links)]

    def begin(self, sync_every: int) -> None:
        """Start counting (after start()): the run's H is known."""
        self.sync_every = sync_every
        now = self.clock()
        n = self.num_links
        for i, link in enumerate(self.links):
            link.started = now
            link.first_sync = -(-(i + 1) * sync_every // n) if self.streaming else sync_every

    def count(self, tokens: int, loss: float | None) -> None:
        for link in self.links:
            link.steps += 1
            link.tokens += int(tokens)
            if loss is not None:
                link.losses.append(float(loss))

    def due_by_steps(self, busy: set[int]) -> list[int]:
        """Links whose step count is up (``busy``: links with an exchange still in flight wait)."""
        return [
            i
            for i, link in enumerate(self.links)
            if i not in busy and link.steps >= (link.first_sync if link.pushed == 0 else self.sync_every)
        ]

    def budget_spent(self) -> bool:
        return self.clock() - self.links[0].started >= self.sync_every_seconds

    def was_blocked(self, seconds: float) -> None:
        """The island spent ``seconds`` on an exchange (encoding, waiting, applying)."""
        for link in self.links:
            link.blocked += seconds

    def synced(self, indices: list[int]) -> None:
        now = self.clock()
        for i in indices:
            self.links[i].restart(now)
