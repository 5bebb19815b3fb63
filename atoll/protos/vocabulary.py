"""The protocol's own words, defined once for both ends: what a tensor is (:class:`TensorKind`), what
a push is (:class:`PushKind`), what became of it (:class:`PushOutcome`) and what a pull answers
(:class:`UpdateKind`). The messages (:mod:`atoll.protos.messages`) use these; only the converters know
atoll.v1's protobuf enums. Values name what happened, so nothing is matched by text."""

from __future__ import annotations

import enum


class TensorKind(enum.Enum):
    PARAMETER = "parameter"
    """Trained: the outer optimizer steps it."""
    BUFFER = "buffer"
    """A floating-point buffer: averaged over the islands, no outer momentum."""


class PushKind(enum.Enum):
    DELTA = "delta"
    """A pseudo-gradient for a round."""
    INIT = "init"
    """θ_0, from the island holding the bootstrap claim."""


class PushOutcome(enum.Enum):
    COMMITTED = "committed"
    """The island's contribution counts in the open round (or θ_0 is in)."""
    STAGED = "staged"
    """This rank is in; other ranks of the island are still missing."""
    DUPLICATE = "duplicate"
    """Received before: nothing changed."""
    FOLDED = "folded"
    """Late, folded into the open round with a staleness weight."""
    ROUND_CLOSED = "round_closed"
    """The round closed without it: the island keeps its work and carries it into its next push."""
    RUN_COMPLETE = "run_complete"
    """The run reached its total rounds."""


class UpdateKind(enum.Enum):
    NOT_READY = "not_ready"
    """The round's outer step is not made (or not durable) yet: the answer says what it waits for."""
    FULL = "full"
    """θ itself (an island that is behind, ahead, or new)."""
    DELTA = "delta"
    """The encoded outer update past the island's round."""
