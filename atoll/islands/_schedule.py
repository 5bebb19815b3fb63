"""When each coordinator route is due to sync, and what its round has counted so far.

Plain DiLoCo: every route after H inner steps. Streaming (fragments): route p first after
⌈(p+1)·H/P⌉ steps, then every H, so each sync moves about 1/P of the model. Time budget
(``sync_every_seconds``): every route once the budget since its last sync is spent.

Decoupled runs: the coordinator says where the island's push landed in its round, seconds after the
median of the round's fresh pushes (:mod:`atoll.coordinator.policy.phase`), and the island moves its
next push by it (:meth:`RouteCount.aligned`): the next push alone by half of it (the phase), and every push after
by a tenth (the period, so an island a little slower per step than the others takes a few steps fewer
a round). Nothing else brings pushes together in a run where no island waits; an island whose push
lands first trains on a θ the round is about to replace until the others come.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

PHASE_GAIN = 0.5
"""Of where a push landed (in the island's steps), what its next push moves by."""
PERIOD_GAIN = 0.1
"""... and what every push after moves by. A push's offset x from the median and its island's period v
(in seconds, from round to round): x' = (1 - PHASE_GAIN - PERIOD_GAIN)·x + v, v' = v - PERIOD_GAIN·x,
which settles only for 0 < PHASE_GAIN < 2 and 0 < PERIOD_GAIN < 4 - 2·PHASE_GAIN (past that the pushes
swing apart: tests/coordinator/test_push_phase.py); at 0.5 and 0.1 an offset shrinks by ~0.7 a round."""


@dataclass
class RouteCount:
    """One route's round so far."""

    first_sync: int = 0
    """Inner steps before this route's first sync (streaming staggers them); later ones every H."""
    steps: int = 0
    tokens: int = 0
    losses: list[float] = field(default_factory=list)
    started: float = 0.0
    """Clock time the round started (the time budget counts from here)."""
    pushed: int = 0
    """Rounds this route pushed since start()."""
    blocked: float = 0.0
    """Seconds the island was blocked on exchanges since this route's round started."""
    carried: tuple[int, int, float] = (0, 0, 0.0)
    """(steps, island tokens, compute seconds) of a dropped push whose progress the next push carries."""
    period: float = 0.0
    """Decoupled: inner steps added to H for every push (< 0: fewer), from where its pushes landed."""
    shift: int = 0
    """Decoupled: inner steps added for the next push only (its phase)."""

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
        self.shift = 0

    def due_after(self, sync_every: int) -> int:
        """Inner steps in this round before it pushes: H moved by its alignment, within [H/2, 2H]."""
        if self.pushed == 0:
            return self.first_sync
        return max(-(-sync_every // 2), min(2 * sync_every, sync_every + round(self.period) + self.shift))

    def aligned(self, offset_seconds: float, step_seconds: float, sync_every: int) -> None:
        """Its last push landed ``offset_seconds`` after the round's median (``step_seconds``: its inner
        step's time): the next push moves by :data:`PHASE_GAIN` of that, every push by :data:`PERIOD_GAIN`
        (the period kept within [-H/2, H] steps, so an island always late cannot wind it up)."""
        if not (step_seconds > 0 and math.isfinite(offset_seconds) and math.isfinite(step_seconds)):
            return
        steps = max(-2.0 * sync_every, min(2.0 * sync_every, offset_seconds / step_seconds))
        self.period = max(-sync_every / 2, min(float(sync_every), self.period - PERIOD_GAIN * steps))
        self.shift = -round(PHASE_GAIN * steps)

    def carry(self, steps: int, tokens: int, compute_seconds: float) -> None:
        """A push of this route was dropped; its work stays in θ and goes with the next push."""
        s, t, c = self.carried
        self.carried = (s + steps, t + tokens, c + compute_seconds)

    def state_dict(self) -> dict:
        return {
            "steps": self.steps,
            "tokens": self.tokens,
            "losses": list(self.losses),
            "pushed": self.pushed,
            "carried": list(self.carried),
            "period": self.period,
            "shift": self.shift,
        }

    def load_state_dict(self, sd: dict) -> None:
        self.steps, self.tokens, self.losses = int(sd["steps"]), int(sd["tokens"]), list(sd["losses"])
        self.pushed = int(sd["pushed"])
        s, t, c = sd.get("carried", (0, 0, 0.0))  # absent in checkpoints of older releases
        self.carried = (int(s), int(t), float(c))
        self.period, self.shift = float(sd.get("period", 0.0)), int(sd.get("shift", 0))  # (older checkpoints)


class Schedule:
    def __init__(
        self,
        num_routes: int,
        *,
        streaming: bool,
        sync_every_seconds: float | None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.num_routes = num_routes
        self.streaming = streaming
        self.sync_every_seconds = sync_every_seconds
        self.clock = clock
        self.sync_every = 0
        self.routes = [RouteCount() for _ in range(num_routes)]

    def begin(self, sync_every: int) -> None:
        """Start counting (after start()): the run's H is known."""
        self.sync_every = sync_every
        now = self.clock()
        n = self.num_routes
        for i, route in enumerate(self.routes):
            route.started = now
            route.first_sync = -(-(i + 1) * sync_every // n) if self.streaming else sync_every

    def count(self, tokens: int, loss: float | None) -> None:
        for route in self.routes:
            route.steps += 1
            route.tokens += int(tokens)
            if loss is not None:
                route.losses.append(float(loss))

    def due_by_steps(self, busy: set[int]) -> list[int]:
        """Routes whose step count is up (``busy``: routes with an exchange still in flight wait)."""
        return [
            i
            for i, route in enumerate(self.routes)
            if i not in busy and route.steps >= route.due_after(self.sync_every)
        ]

    def budget_spent(self) -> bool:
        return self.clock() - self.routes[0].started >= self.sync_every_seconds

    def was_blocked(self, seconds: float) -> None:
        """The island spent ``seconds`` on an exchange (encoding, waiting, applying)."""
        for route in self.routes:
            route.blocked += seconds

    def synced(self, indices: list[int]) -> None:
        now = self.clock()
        for i in indices:
            self.routes[i].restart(now)


WAIT_WHILE_WITHIN = 1.5
"""A decoupled island waits for its update while its last exchange came back within this many times
the wait: equal islands' exchanges (their pushes' spread) sit about at the wait, a fast island's
behind rounds that wait for slower ones well past it."""


def update_wait_seconds(fraction: float, compute_seconds: float, last_exchange: float | None) -> float:
    """How long a decoupled island waits for the update of the push it just made: ``fraction`` of the
    compute time of the push's steps, when its last exchange came back within ``WAIT_WHILE_WITHIN``
    times that (its rounds close soon after its pushes: islands of equal speed); none when the last
    took longer (its rounds wait for slower islands, and waiting would only idle it: under the chaos
    trace, waiting 0.2 of every cycle whatever came before idled the fast islands 9-13%, goodput 0.86)."""
    cap = fraction * compute_seconds
    return 0.0 if last_exchange is not None and last_exchange > WAIT_WHILE_WITHIN * cap else cap
