"""The objects that own the run's state, handed together to the code that acts on them."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from atoll.coordinator.accumulator import RoundAccumulator
from atoll.coordinator.config import RunConfig
from atoll.coordinator.ledger import Ledger
from atoll.coordinator.membership import Membership
from atoll.coordinator.model import GlobalModel


@dataclass(frozen=True)
class Owners:
    """Built once by :class:`~atoll.coordinator.core.RunState`; :mod:`pushes` and :mod:`pulls` act
    on these and hold no state of their own."""

    config: Callable[[], RunConfig]
    """The run's config as it is now (an operator may change operational fields on a live run)."""
    membership: Membership
    accumulator: RoundAccumulator
    model: GlobalModel
    ledger: Ledger
