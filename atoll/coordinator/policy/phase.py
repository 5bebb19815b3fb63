"""Where each island's push landed in its round, for the islands to push together (decoupled runs).

In a decoupled run no island waits, so nothing brings the islands' pushes back together once they
drift apart: an island whose push commits first trains on while the round waits for the others, and
all of that training starts from a θ the round is about to replace (measured: islands of equal speed a
third to half a round apart, 2-5% behind sync at equal tokens). The coordinator tells each
island how far its push landed from the middle of the round's fresh pushes; the island shifts its next
push by part of it (``RouteCount.aligned`` in ``atoll/islands/_schedule.py``). Measured against the median, one
island far behind (a slow one) does not pull the others' pushes towards it: it is the one told to push
sooner.
"""

from __future__ import annotations

import statistics


def arrival_offsets(commits: dict[str, float]) -> dict[str, float]:
    """Each island's commit time minus the median of the round's commit times (``commits``: island ->
    clock time its fresh push committed); empty for fewer than two islands (nothing to align with)."""
    if len(commits) < 2:
        return {}
    middle = statistics.median(commits.values())
    return {island: at - middle for island, at in sorted(commits.items())}
