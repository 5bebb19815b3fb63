"""What the island side raises when the coordinator refuses it for a reason the user must act on."""

from __future__ import annotations


class CoordinatorRefused(RuntimeError):
    """The coordinator refused the island (its model, codec, run id or island id does not fit the run,
    or an operator evicted it). ``reason`` is the protocol's reason (``"REASON_MODEL_MISMATCH"``...);
    the message says what to change. Retrying does not help."""

    def __init__(self, reason: str | None, message: str) -> None:
        super().__init__(message)
        self.reason = reason


class WrongEndpoint(CoordinatorRefused):
    """The coordinator's address takes connections but not the island's calls, for a reason of the
    island's setup (TLS against a plaintext coordinator or the reverse, a client certificate missing or
    not trusted, a server certificate that does not verify, its admin port): the message says what to
    change. Found within seconds of the first Join (:mod:`atoll.islands._transport.probe`); retrying does not help."""

    def __init__(self, message: str) -> None:
        super().__init__(None, message)


class ProtocolError(RuntimeError):
    """The coordinator sent something that breaks the protocol."""


class CoordinatorUnreachable(ConnectionError):
    """The coordinator could not be reached within the island's connect deadline."""


class Stopping(RuntimeError):
    """The island is stopping (SIGTERM): a call's retries ended without waiting out their deadline."""


class PartialUpdate(ConnectionError):
    """A pulled update broke off after some of its entries were applied: the island resyncs from the
    full θ (the applied part cannot be taken back)."""


class QuorumGone(RuntimeError):
    """The island's last round can never close: the coordinator reports fewer islands committed or live
    than the quorum (the others left or went silent). Raised instead of waiting for islands to return
    only after :meth:`DiLoCo.last_round`; the message says what would unblock the round."""


class Preempted(SystemExit):
    """SIGTERM arrived (Slurm preemption, Kubernetes pod deletion, ``kill``): :class:`DiLoCo` stopped at
    the end of an inner step, or abandoned the exchange it was waiting on, so the island can save a
    checkpoint and leave. A ``SystemExit`` with code 143 (128 + SIGTERM): unhandled, the process exits
    with it once ``with DiLoCo(...)`` has left the run."""

    def __init__(self) -> None:
        super().__init__(143)
