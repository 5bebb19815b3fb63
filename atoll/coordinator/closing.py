"""Closing rounds: the decider task, the outer step, and persist-before-publish with retries.

The decider evaluates :func:`~atoll.coordinator.rounds.decide` on every change and at deadlines.
A closed round is *sealed* (its outer step computed; it takes no more pushes) until its state is
saved; only then is θ_{r+1} published. A failed save (a full disk) is logged at ERROR with its
cause, reported by /healthz, and retried with capped backoff: rounds resume by themselves once a
save succeeds. Any other exception escapes :func:`run_decider`, so the server exits non-zero
(never a silently dead task).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

import torch

from atoll.coordinator import persistence
from atoll.coordinator.core import RunState, wait_event
from atoll.coordinator.membership import IslandState
from atoll.coordinator.rounds import Decision, IslandView, RoundView, decide, next_wakeup, stall

log = logging.getLogger("atoll.coordinator")

SAVE_RETRY_SECONDS = (0.5, 30.0)
"""First wait after a failed save, and the cap of its doubling."""


@dataclass
class Sealed:
    round: int
    params: dict[str, torch.Tensor]
    payloads: dict[str, bytearray]
    record: dict
    islands: frozenset[str]
    """Islands whose push counted (pulls answer committed=True for them meanwhile)."""
    retry_in: float = SAVE_RETRY_SECONDS[0]
    failures: int = 0


def view(s: RunState) -> RoundView:
    islands = tuple(
        IslandView(
            island_id=i.island_id, lease_expires_at=i.lease_expires_at, committed=i.island_id in s.staging.committed
        )
        for i in s.membership.islands.values()
    )
    extra = tuple(  # committed islands that left since still count
        IslandView(island_id=k, lease_expires_at=0.0, committed=True)
        for k in s.staging.committed
        if k not in s.membership.islands
    )
    return RoundView(round=s.round, opened_at=s.opened_at, islands=islands + extra)


async def run_decider(s: RunState) -> None:
    """Background task: close rounds when ``decide`` says so, retry a pending save, log what the round
    waits for and when it cannot close at all."""
    last_reason = ""
    while True:
        timeout = 1.0
        for rec in s.membership.newly_expired():
            log.warning(
                "%sisland %s: lease expired (%.0fs without a call); not waited for until it is back",
                s.name,
                rec.island_id,
                s.config.lease_seconds,
            )
        if s.sealed is not None:
            if not await try_publish(s):
                await asyncio.sleep(s.sealed.retry_in)
                continue
            await asyncio.to_thread(persistence.prune, s.state_dir, s.keep_snapshots)
        elif s.params is not None and not s.run_complete:
            now = s.clock()
            v = view(s)
            decision, reason = decide(now, v, s.policy())
            if decision is Decision.CLOSE:
                await close_round(s, reason)
                continue
            s.waiting = reason
            if reason != last_reason:
                log.info("%s%s", s.name, reason)
                last_reason = reason
            stuck = stall(now, v, s.policy())
            if stuck != s.stall:
                if stuck:
                    log.warning("%s%s", s.name, stuck)
                elif s.stall:
                    log.info("%sround %d can reach quorum again", s.name, s.round)
                s.stall = stuck
            wake = next_wakeup(now, v, s.policy())
            if wake is not None:
                timeout = min(max(wake - now, 0.005), 1.0)
        await wait_event(s.poke, timeout)
        s.poke.clear()


async def close_round(s: RunState, reason: str) -> None:
    async with s.lock:
        committed = s.staging.committed
        if not committed or s.sealed is not None:
            return
        started = time.perf_counter()
        r = s.round
        total = sum(c.tokens for c in committed.values())
        silent = sorted(i for i, c in committed.items() if c.tokens == 0)
        if silent and total:
            log.warning(
                "%sround %d: islands %s reported no tokens while others did; each weighs 1 token in the mean "
                "(their step() calls need tokens=)",
                s.name,
                r,
                ", ".join(silent),
            )
        losses = [(max(c.tokens, 1), c.loss) for c in committed.values() if c.loss is not None]
        loss = sum(t * v for t, v in losses) / sum(t for t, _ in losses) if losses else None
        await asyncio.to_thread(s.downlink.release_latest)
        params, payloads = await asyncio.to_thread(s.outer_step, s.staging.weight_total())
        record = {
            "round": r,
            "islands": sorted(committed),
            "late": sorted([island, rnd] for island, rnd in s.staging.late),
            "states": s.states(),
            "tokens": total,
            "tokens_by_island": {i: c.tokens for i, c in sorted(committed.items())},
            "bytes_by_island": {i: c.num_bytes for i, c in sorted(committed.items())},
            "loss": loss,
            "bytes_in": sum(c.num_bytes for c in committed.values()),
            "bytes_out_per_island": sum(len(p) for p in payloads.values()),
            "reason": reason,
            "seconds_open": s.clock() - s.opened_at,
            "outer_step_seconds": time.perf_counter() - started,
        }
        s.sealed = Sealed(r, params, payloads, record, frozenset(committed))
        keep_from = s.round + 1 - (s.config.max_staleness if s.config.late_policy == "fold" else 0)
        s.staging.advance(keep_from)
    if await try_publish(s):
        await asyncio.to_thread(persistence.prune, s.state_dir, s.keep_snapshots)


async def try_publish(s: RunState) -> bool:
    """Save the sealed round (update, then snapshot) and publish θ_{r+1}; False if the save failed."""
    async with s.lock:
        sealed = s.sealed
        if sealed is None:
            return True
        started = time.perf_counter()
        history = [*s.history, sealed.record]
        try:
            await asyncio.to_thread(_persist, s, sealed, history)
        except Exception as err:  # a full disk, a read-only or vanished dir: retried until it works
            sealed.failures += 1
            s.problem = f"saving round {sealed.round} failed ({err}); the round stays unpublished and is retried"
            if sealed.failures == 1 or sealed.failures % 20 == 0:
                log.error("%s%s (attempt %d)", s.name, s.problem, sealed.failures)
            sealed.retry_in = min(sealed.retry_in * 2, SAVE_RETRY_SECONDS[1])
            return False
        if s.problem is not None:
            log.warning(
                "%ssaving works again: round %d saved after %d failed attempts", s.name, sealed.round, sealed.failures
            )
            s.problem = None
        published = time.perf_counter()
        sealed.record["persist_seconds"] = published - started
        s.params, s.history = sealed.params, history
        s.round = sealed.round + 1
        s.downlink.publish(s.round, sealed.payloads)
        s.sealed = None
        s._reset_accum()
        s.opened_at = s.clock()
        record = sealed.record
        log.info(
            "%sclosed round %d (%s): loss %s, outer step %.3fs + persist %.3fs",
            s.name,
            sealed.round,
            record["reason"],
            "n/a" if record["loss"] is None else f"{record['loss']:.4f}",
            record["outer_step_seconds"],
            record["persist_seconds"],
        )
        if s.run_complete:
            log.warning("%srun %s is complete after %d rounds", s.name, s.config.run_id, s.round)
        s.publish()
        record["publish_seconds"] = time.perf_counter() - published
        return True


def _persist(s: RunState, sealed: Sealed, history: list[dict]) -> None:
    """The snapshot of θ_{r+1} (durable); its update is written once published (Downlink.publish),
    and older snapshots are pruned after the publish (:func:`close_round`)."""
    persistence.save(s.state_dir, s.snapshot(sealed.params, sealed.round + 1, history), keep=None)


__all__ = ["IslandState", "Sealed", "close_round", "run_decider", "try_publish", "view"]
