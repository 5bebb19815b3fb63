"""What the transports count: bytes in and out, and every refusal by kind. Written by the gRPC service
and the bulk port (which calls it), read by the admin server's /metrics and /api/status."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar


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

    def as_dict(self) -> dict[str, int]:
        return dataclasses.asdict(self)
