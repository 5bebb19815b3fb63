"""Refusals of the coordinator core: a reason (``atoll.v1.Reason``, :mod:`atoll.protos.reasons`) as data.

The core raises :class:`RequestError`; ``service.py`` turns it into a gRPC status whose details
carry the reason, so islands act on the reason, never on the text.
"""

from __future__ import annotations

from atoll.protos.reasons import CODE, Reason


class RequestError(Exception):
    """A request the coordinator refuses; changes no state. ``code``: the gRPC status code's name
    (the reason's usual one unless given)."""

    def __init__(self, reason: Reason, message: str, *, code: str | None = None, chain: tuple[str, ...] = ()) -> None:
        """``chain``: a relay's refusal of a relay, the relays it waits on (itself first)."""
        super().__init__(message)
        self.reason = reason
        self.code = code or CODE[reason]
        self.message = message
        self.chain = chain


def refuse(reason: Reason, message: str) -> RequestError:
    return RequestError(reason, message)


def invalid(message: str) -> RequestError:
    return RequestError(Reason.BAD_REQUEST, message)


__all__ = ["Reason", "RequestError", "invalid", "refuse"]
