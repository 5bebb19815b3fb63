"""The order a sync round's contributions enter its sum in: fixed by the islands' ids, not by when their
pushes arrive, so θ_{r+1} has the same bits for the same set of pushes however they raced.

fp32 addition commutes but does not associate: ``(a + b) + c`` and ``(a + c) + b`` may differ in the
last bit, so with three or more contributions the sum's bits depend on the order they are added in.
The fixed order is the left fold over the committed islands sorted by id,
``((c1 + c2) + c3) + ...``, where c1 and c2 may come in either order (the first is written into the
sum, the second added to it: the same bits either way). A contribution that arrives before one that
sorts ahead of it is held (still encoded) until that one is in the sum, or can no longer come.

These are pure functions of ids and counts; the accumulator holds the contributions and the round's
sequence, the core decides when to ask.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable

FIXED = "fixed"
ARRIVAL = "arrival"
"""The round record's ``sum_order``: its sum is the fixed order's, or some other order's (a push held
past the budget's room, a late delta folded in, an island that joined mid-round and sorts ahead)."""


def may_add(island: str, added: int, waiting: Iterable[str]) -> bool:
    """Whether ``island``'s contribution may enter the sum now, ``added`` contributions being in it and
    the islands ``waiting`` (not in it: their push may still come, or it is held) still to come: the
    sum stays a prefix of the fixed order whatever set of them ends up in it. True when none of them
    sorts ahead of ``island``, or when the sum is empty and one does (that one comes second: the first
    two commute)."""
    ahead = sum(1 for w in waiting if w < island)
    return ahead == 0 or (added == 0 and ahead == 1)


def ready(held: Iterable[str], added: int, waiting: Iterable[str]) -> list[str]:
    """The held islands that may enter the sum now, in the order they must: the smallest first, as long
    as each may (:func:`may_add`; the held ones after it sort after it, so only ``waiting`` can be
    ahead). One sort of each, and a binary search a held island: a root of a thousand islands asks
    after every push."""
    held = sorted(set(held))
    waiting = sorted(set(waiting).difference(held))
    out: list[str] = []
    for island in held:
        ahead = bisect.bisect_left(waiting, island)
        if not (ahead == 0 or (added + len(out) == 0 and ahead == 1)):
            break
        out.append(island)
    return out


def order_of(sequence: list[str]) -> str:
    """:data:`FIXED` if ``sequence`` (the islands in the order they entered the sum) is the fixed order
    of its own set, else :data:`ARRIVAL`."""
    want = sorted(sequence)
    return FIXED if sequence[2:] == want[2:] and sorted(sequence[:2]) == want[:2] else ARRIVAL
