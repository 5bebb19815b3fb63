"""What a coordinator that is a relay (``atoll relay``) asks of its upstream: the seam between the run's
core, which serves the relay's islands as any coordinator does, and :mod:`atoll.relay`, which speaks
to the coordinator above. A root coordinator has none (``RunState.upstream`` is None).

The core calls it at five points: before a join (the relay joins its own upstream first, and learns
the run's configuration there), to check a joining relay against the chain (a loop), in place of the
outer step (the relay sends its islands' weighted mean up and gets the round's update back), after it
(the upstream's further updates, when it moved on by more than one round), and when
θ_0 is sealed (a relay that holds the upstream's bootstrap claim sends its island's θ_0 up).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch

from atoll.coordinator.messages import JoinRequest
from atoll.coordinator.state.plans import Committed


class Upstream(Protocol):
    chain: tuple[str, ...]
    """This relay's id, then the relays above it, nearest first (the root is not one)."""

    async def before_join(self, req: JoinRequest) -> None:
        """Join the upstream if not yet (RequestError RELAY_NOT_READY, with the chain it waits on, while
        it cannot: the joiner retries)."""
        ...

    def step(
        self,
        round_: int,
        sums: dict[str, torch.Tensor],
        weight: float,
        members: list[tuple[str, Committed]],
        made: Callable[[str, bytearray], None],
    ) -> tuple[dict[str, torch.Tensor], dict[str, bytearray] | None, int]:
        """(worker thread) The round's outer step, from upstream: ``sums`` holds Σ w_i Δ_i of
        ``members`` (Σ w_i = ``weight``); returns θ_{r+1} (in ``sums``' storage), the update's
        payloads as the upstream sent them, each handed to ``made`` as it is final, and the round
        that opens (r + 1). An upstream that answered with θ itself (it moved on by more than
        catching up pays) gives that θ, None and the round it opens. ``members``: each
        contribution's (island, record), folded late ones too (an island may have two)."""
        ...

    def follow(
        self, round_: int, params: dict[str, torch.Tensor]
    ) -> tuple[dict[str, torch.Tensor], dict[str, bytearray] | None, int] | None:
        """(worker thread) The upstream moved on by more than the round stepped: its next update applied
        to ``params`` (as :meth:`step` returns it, in new tensors), or None when it has no more."""
        ...

    def send_theta0(self, params: dict[str, torch.Tensor]) -> None:
        """(worker thread) θ_0 from this relay's bootstrap island, sent up (the upstream's claim is ours)."""
        ...
