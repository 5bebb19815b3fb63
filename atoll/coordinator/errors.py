"""Refusals of the coordinator core: a status code and a reason, as data.

The core raises :class:`RequestError`; ``service.py`` turns it into a gRPC status whose details
carry the reason (``atoll.v1.Reason``), so islands act on the reason, never on the text.
"""

from __future__ import annotations

import enum


class Code(enum.Enum):
    """The gRPC status code of a refusal (by name; ``service.py`` maps it)."""

    INVALID_ARGUMENT = "INVALID_ARGUMENT"
    FAILED_PRECONDITION = "FAILED_PRECONDITION"
    NOT_FOUND = "NOT_FOUND"
    ALREADY_EXISTS = "ALREADY_EXISTS"
    PERMISSION_DENIED = "PERMISSION_DENIED"
    UNAUTHENTICATED = "UNAUTHENTICATED"
    RESOURCE_EXHAUSTED = "RESOURCE_EXHAUSTED"
    UNAVAILABLE = "UNAVAILABLE"
    ABORTED = "ABORTED"


class Reason(enum.Enum):
    """Mirrors ``atoll.v1.Reason`` (without its ``REASON_`` prefix); each with its usual code."""

    BAD_REQUEST = Code.INVALID_ARGUMENT
    WRONG_RUN = Code.FAILED_PRECONDITION
    NOT_JOINED = Code.NOT_FOUND
    MODEL_MISMATCH = Code.FAILED_PRECONDITION
    CODEC_MISMATCH = Code.FAILED_PRECONDITION
    SHARD_MISMATCH = Code.FAILED_PRECONDITION
    SESSION_CONFLICT = Code.ALREADY_EXISTS
    EVICTED = Code.PERMISSION_DENIED
    NO_PARAMETERS = Code.UNAVAILABLE
    NOT_BOOTSTRAPPER = Code.FAILED_PRECONDITION
    ROUND_IN_FUTURE = Code.FAILED_PRECONDITION
    ROUND_CLOSED = Code.FAILED_PRECONDITION
    RUN_COMPLETE = Code.FAILED_PRECONDITION
    PUSH_IN_PROGRESS = Code.RESOURCE_EXHAUSTED
    INFLIGHT_BUDGET = Code.RESOURCE_EXHAUSTED
    TOKENS_OUT_OF_RANGE = Code.INVALID_ARGUMENT
    DELTA_TOO_LARGE = Code.INVALID_ARGUMENT
    BAD_PAYLOAD = Code.INVALID_ARGUMENT
    INCOMPLETE_ISLAND = Code.INVALID_ARGUMENT
    UNAUTHENTICATED = Code.UNAUTHENTICATED
    PERMISSION_DENIED = Code.PERMISSION_DENIED
    STREAM_IDLE = Code.ABORTED

    def __new__(cls, code: Code):
        # Several reasons share a code: give each member its own identity (its name).
        obj = object.__new__(cls)
        obj._value_ = len(cls.__members__) + 1
        obj.code = code
        return obj


class RequestError(Exception):
    """A request the coordinator refuses; changes no state."""

    def __init__(self, reason: Reason, message: str, *, code: Code | None = None) -> None:
        super().__init__(message)
        self.reason = reason
        self.code = code or reason.code
        self.message = message


def refuse(reason: Reason, message: str) -> RequestError:
    return RequestError(reason, message)


def invalid(message: str) -> RequestError:
    return RequestError(Reason.BAD_REQUEST, message)
