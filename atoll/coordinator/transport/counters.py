"""What the transports count: bytes in and out, every refusal by kind, and every byte that crossed the
wire again by its cause. Written by the gRPC service and the bulk port (which calls it), read by the
admin server's /metrics and /api/status."""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass, field
from typing import ClassVar


class Resent(enum.Enum):
    """Why bytes crossed the wire that a push or a pull had carried (or started to carry) before."""

    PUSH_CUT = "push_cut"
    """A push stream broke part way and what had come of it was dropped (on gRPC, or parked on the bulk
    port past its retry): its retry sends it again. (A retry that resumes a parked push sends nothing
    again: ``bulk_resumed_bytes``.)"""
    PUSH_UNREAD = "push_unread"
    """An eager push (its data sent without waiting for admission) answered at its header (refused for
    the in-flight budget or an open stream, a duplicate, too late): its data came and was read into
    nothing."""
    PUSH_DUPLICATE = "push_duplicate"
    """A push read whole that had counted already (its island did not hear the first answer)."""
    PULL_AGAIN = "pull_again"
    """A pull answered with what the same rank of the island was sent before for the same regions (a
    stream cut, a tentative update not saved in time, an island restarted), less what a resumed pull
    skipped. A cut answer counts what it made before the cut was noticed."""


@dataclass
class Counters:
    HELP: ClassVar[dict[str, str]] = {
        "bytes_in": "Payload bytes received in accepted pushes",
        "bytes_out": "Payload bytes sent in pulls",
        "pushes_committed": "Islands' contributions committed to their round",
        "pushes_late_folded": "Late pushes folded into a later round",
        "pushes_late_dropped": "Pushes whose work counts nowhere (a delta for a round before the island joined)",
        "pushes_carried": "Pushes too stale to fold: nothing added; the island carries their work into its next push",
        "pushes_refused": "Pushes refused for bad input",
        "joins_refused": "Joins refused (wrong run, model, codec, shard, a second process, eviction, bad request)",
        "pushes_busy": "Pushes refused at their header, before their data flowed: in-flight budget spent or a "
        "stream of the same island and rank open (the island retries)",
        "pulls_busy": "Pulls refused before their data flowed: the pull memory budget was spent (the island retries)",
        "pulls_idle": "Pull streams ended because their peer took nothing for the idle limit",
        "bulk_calls": "Pushes and pulls that came on the bulk port (the others came over gRPC)",
        "bulk_connections": "Connections the bulk port accepted (a striped call takes several, a kept one "
        "carries call after call)",
        "bulk_kept_calls": "Bulk-port calls that came on a connection kept from an earlier call (no handshake)",
        "bulk_timeouts": "Bulk-port connections closed for making no progress (a preamble past its deadline, "
        "a stream idle past --stream-idle-seconds)",
        "bulk_over_cap": "Bulk-port connections closed as they came because the port had its maximum open",
        "bulk_resumes": "Pushes cut part way on the bulk port that their retry resumed",
        "bulk_pull_resumes": "Pulls that broke part way on the bulk port and asked for the rest of their answer",
        "bulk_resumed_bytes": "Bytes resumed pushes and pulls did not send again",
    }
    RESENT_HELP: ClassVar[str] = "Payload bytes that crossed the wire again, by cause (docs/operations.md)"
    bytes_in: int = 0
    bytes_out: int = 0
    pushes_committed: int = 0
    pushes_late_folded: int = 0
    pushes_late_dropped: int = 0
    pushes_carried: int = 0
    pushes_refused: int = 0
    pushes_busy: int = 0
    pulls_busy: int = 0
    pulls_idle: int = 0
    joins_refused: int = 0
    bulk_calls: int = 0
    bulk_connections: int = 0
    bulk_kept_calls: int = 0
    bulk_timeouts: int = 0
    bulk_over_cap: int = 0
    bulk_resumes: int = 0
    bulk_pull_resumes: int = 0
    bulk_resumed_bytes: int = 0
    resent_bytes: dict[str, int] = field(default_factory=lambda: {cause.value: 0 for cause in Resent})
    """By :class:`Resent` value."""

    def resent(self, cause: Resent, num_bytes: int) -> None:
        self.resent_bytes[cause.value] += num_bytes

    def as_dict(self) -> dict[str, int]:
        return dataclasses.asdict(self)
