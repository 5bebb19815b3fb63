"""The run's terms as the island learns them at Join: its H, its outer mode, how far behind a
decoupled push may fall, and the codec this island pushes with. Settled once from every coordinator
shard's answer (:func:`settle`) and kept by the link (:attr:`CoordinatorLink.terms`)."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from atoll.compression import ErrorFeedback, get_codec
from atoll.islands._messages import JoinAnswer
from atoll.islands._options import DiLoCoOptions
from atoll.islands._transport.session import Session

log = logging.getLogger("atoll.island")


@dataclass(frozen=True)
class IslandTerms:
    """The terms this island follows, settled from the Join answers (the wire's RunTerms, and its own
    options where they apply)."""

    sync_every: int
    """H: inner steps per round (the run's, unless the island set its own)."""
    decoupled: bool
    """The run's outer mode is decoupled: the island never waits for an outer step (see DiLoCo.step)."""
    push_behind: int
    """Decoupled: push before H steps once the run is this many rounds past the island's θ (half the
    run's max_staleness, at least 1), so the delta arrives fresh enough to be folded."""
    codec: object
    """The codec this island pushes with: the run's, wrapped in error feedback when the run asks for it."""


def settle(options: DiLoCoOptions, sessions: list[Session], joined: list[JoinAnswer]) -> IslandTerms:
    """The run's terms from the shards' Join answers. The island's own H is warned about when it
    differs; every shard must run the same codec (RuntimeError); ``overlap_steps`` must be below H
    (ValueError). Each session starts at its shard's round (unless it resumed at one)."""
    o = options
    sync_every, codec, decoupled, push_behind = o.sync_every or 0, None, False, 1
    for session, resp in zip(sessions, joined, strict=True):
        c = resp.run
        me = session.me
        if o.sync_every is None:
            sync_every = c.sync_every
        elif o.sync_every != c.sync_every and session.index == 0:
            log.warning(
                "%s: sync_every=%d overrides the run's H=%d for this island (its deltas cover %d inner steps)",
                me.island_id,
                o.sync_every,
                c.sync_every,
                o.sync_every,
            )
        decoupled = c.outer_mode == "decoupled"
        push_behind = max(1, c.max_staleness // 2)
        run_codec = get_codec(resp.codec)
        if codec is None:
            ef = c.error_feedback and run_codec.lossy
            codec = ErrorFeedback(run_codec, c.error_feedback_decay) if ef else run_codec
        elif codec.spec != run_codec.spec:
            raise RuntimeError(f"coordinator shard {session.index} runs codec {resp.codec}, another {codec.spec}")
        if o.overlap_steps and decoupled and session.index == 0:
            log.warning("%s: overlap_steps is ignored in a decoupled run", me.island_id)
        elif o.overlap_steps and o.sync_every_seconds is None and o.overlap_steps >= sync_every:
            raise ValueError(f"overlap_steps ({o.overlap_steps}) must be below the run's H ({sync_every})")
        if session.round < 0:
            session.round = resp.round
        log.info(
            "%s[%d/%d] joined run %s (shard %d/%d) at round %d (H=%d, codec %s, %s)",
            me.island_id,
            me.rank,
            me.num_ranks,
            me.run_id,
            session.index,
            len(sessions),
            resp.round,
            sync_every,
            resp.codec,
            "decoupled" if decoupled else "sync",
        )
    return IslandTerms(sync_every, decoupled, push_behind, codec)
