"""Island side: the DiLoCo algorithm (:class:`DiLoCo`) and its connection to the coordinator
(:class:`CoordinatorLink`).

    from atoll.islands import CoordinatorLink, DiLoCo

    link = CoordinatorLink("coord.example:7070", run_id="my-run", island_id="site-a")
    with DiLoCo(model, link) as sync:
        ...

What a user needs is exported here (``__all__``), with :mod:`atoll.islands.errors` and
:mod:`atoll.islands.checkpoint`; the modules named ``_*`` are internal and may change in any release.
"""

from atoll.islands._diloco import DiLoCo
from atoll.islands._flight import RoundStats
from atoll.islands._link import CoordinatorLink, Transport, WireTransport
from atoll.islands._options import DiLoCoOptions
from atoll.islands._transport.client import ClientTls, CoordinatorClient, RetryPolicy
from atoll.islands.errors import CoordinatorRefused, CoordinatorUnreachable, Preempted, QuorumGone

__all__ = [
    "ClientTls",
    "CoordinatorClient",
    "CoordinatorLink",
    "CoordinatorRefused",
    "CoordinatorUnreachable",
    "DiLoCo",
    "DiLoCoOptions",
    "IslandCheckpoint",
    "Preempted",
    "QuorumGone",
    "RetryPolicy",
    "RoundStats",
    "Transport",
    "WireTransport",
]


def __getattr__(name: str):
    if name == "IslandCheckpoint":  # torch.distributed.checkpoint costs ~1 s to import: only when asked for
        from atoll.islands.checkpoint import IslandCheckpoint

        return IslandCheckpoint
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
