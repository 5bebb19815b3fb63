"""Island side: the DiLoCo algorithm (:class:`DiLoCo`) and its connection to the coordinator
(:class:`CoordinatorLink`).

    from atoll.islands import CoordinatorLink, DiLoCo

    link = CoordinatorLink("coord.example:7070", run_id="my-run", island_id="site-a")
    with DiLoCo(model, link) as sync:
        ...
"""

from atoll.islands.diloco import DiLoCo
from atoll.islands.errors import CoordinatorRefused, CoordinatorUnreachable, Preempted, QuorumGone
from atoll.islands.exchanges import RoundStats
from atoll.islands.link import CoordinatorLink, Transport
from atoll.islands.options import DiLoCoOptions
from atoll.islands.transport.client import ClientTls, CoordinatorClient, RetryPolicy

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
]


def __getattr__(name: str):
    if name == "IslandCheckpoint":  # torch.distributed.checkpoint costs ~1 s to import: only when asked for
        from atoll.islands.checkpoint import IslandCheckpoint

        return IslandCheckpoint
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
