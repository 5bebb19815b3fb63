"""The objects that own the run's state, handed together to the code that acts on them."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from atoll.coordinator.config import RunConfig
from atoll.coordinator.state.accumulator import RoundAccumulator
from atoll.coordinator.state.ledger import Ledger
from atoll.coordinator.state.membership import Membership
from atoll.coordinator.state.model import GlobalModel


@dataclass(frozen=True)
class Owners:
    """Built once by :class:`~atoll.coordinator.run.run_state.RunState`; :mod:`pushes` and :mod:`pulls` act
    on these and hold no state of their own."""

    config: Callable[[], RunConfig]
    """The run's config as it is now (an operator may change operational fields on a live run)."""
    membership: Membership
    accumulator: RoundAccumulator
    model: GlobalModel
    ledger: Ledger
