"""One session with one coordinator, for a program that speaks to a coordinator as an island does
without being one: a relay (:mod:`atoll.relay`) joins its upstream, pushes its islands' sum and pulls
the update through these. An island's own code uses :class:`~atoll.islands.CoordinatorLink`."""

from atoll.islands._messages import Identity, JoinAnswer, Update
from atoll.islands._transport.addresses import parse_addresses
from atoll.islands._transport.session import Session

__all__ = ["Identity", "JoinAnswer", "Session", "Update", "parse_addresses"]
