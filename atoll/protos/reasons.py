"""The protocol's reasons, derived from the generated ``atoll.v1.Reason`` enum (hand-written, shared by
both ends): what status code a refusal carries, and whether it is final for an island.

The names come from ``coordinator.proto`` alone; this module adds the two facts the proto cannot say.
``tests/protos/test_protos.py`` fails when a reason of the proto has no entry here, or an entry names none.
"""

from __future__ import annotations

import enum

from atoll.protos import coordinator_pb2 as pb

PREFIX = "REASON_"

Reason = enum.Enum(  # type: ignore[misc]
    "Reason",
    {name.removeprefix(PREFIX): name for name, number in pb.Reason.items() if number},
    type=str,
    module=__name__,
)
"""Every ``atoll.v1.Reason`` but UNSPECIFIED. A member is its wire name (``Reason.NOT_JOINED ==
"REASON_NOT_JOINED"``), so code that compared reasons as strings keeps working."""

# The gRPC status code each refusal travels with (by name: the coordinator's core imports no grpc),
# and whether it is final: no retry can fix it, the user must change something.
_TABLE: dict[str, tuple[str, bool]] = {
    "BAD_REQUEST": ("INVALID_ARGUMENT", True),
    "WRONG_RUN": ("FAILED_PRECONDITION", True),
    "NOT_JOINED": ("NOT_FOUND", False),
    "MODEL_MISMATCH": ("FAILED_PRECONDITION", True),
    "CODEC_MISMATCH": ("FAILED_PRECONDITION", True),
    "SHARD_MISMATCH": ("FAILED_PRECONDITION", True),
    "SESSION_CONFLICT": ("ALREADY_EXISTS", True),
    "EVICTED": ("PERMISSION_DENIED", True),
    "NO_PARAMETERS": ("UNAVAILABLE", False),
    "NOT_BOOTSTRAPPER": ("FAILED_PRECONDITION", True),
    "ROUND_IN_FUTURE": ("FAILED_PRECONDITION", False),
    "PUSH_IN_PROGRESS": ("RESOURCE_EXHAUSTED", False),
    "INFLIGHT_BUDGET": ("RESOURCE_EXHAUSTED", False),
    "TOKENS_OUT_OF_RANGE": ("INVALID_ARGUMENT", True),
    "DELTA_TOO_LARGE": ("INVALID_ARGUMENT", False),
    "BAD_PAYLOAD": ("INVALID_ARGUMENT", False),
    "INCOMPLETE_ISLAND": ("INVALID_ARGUMENT", True),
    "UNAUTHENTICATED": ("UNAUTHENTICATED", True),
    "PERMISSION_DENIED": ("PERMISSION_DENIED", True),
    "STREAM_IDLE": ("ABORTED", False),
    "NOT_DURABLE": ("UNAVAILABLE", False),
    "PULL_BUDGET": ("RESOURCE_EXHAUSTED", False),
    "RELAY_LOOP": ("FAILED_PRECONDITION", True),
    "RELAY_NOT_READY": ("UNAVAILABLE", False),
}

CODE: dict[Reason, str] = {Reason[name]: code for name, (code, _) in _TABLE.items()}
"""The gRPC status code name (``grpc.StatusCode[...]``) of each reason."""
FATAL: frozenset[Reason] = frozenset(Reason[name] for name, (_, final) in _TABLE.items() if final)
"""Refusals that retrying cannot fix: an island raises ``CoordinatorRefused``."""


def wire_number(reason: Reason) -> int:
    return pb.Reason.Value(reason.value)


def parse(name: str) -> Reason | None:
    """The reason of a wire name (``"REASON_NOT_JOINED"``), None for one this build does not know."""
    try:
        return Reason(name)
    except ValueError:
        return None
