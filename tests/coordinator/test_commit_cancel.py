"""A push whose call is cancelled while its delta is being decoded into the round's sum (its island
went away after its last byte) still commits whole, and the next push's decode waits for it: the sum
is written by one worker thread at a time, and holds each delta it counts, once."""

from __future__ import annotations

import asyncio
import threading

import numpy as np
from support.core import SHAPES, join, pull, push, rand, run_state

from atoll.coordinator.policy.rounds import Decision, decide
from atoll.coordinator.run.decider import view
from atoll.coordinator.state.accumulator import RoundAccumulator
from atoll.protos.vocabulary import PushKind


def test_a_push_cancelled_mid_decode_commits_whole_before_the_next_push_decodes(tmp_path, monkeypatch):
    s = run_state(tmp_path, outer_lr=0.7, outer_momentum=0.9)
    theta0, da, db = rand(0), rand(1), rand(2)
    for island in ("a", "b"):
        join(s, island)
    assert asyncio.run(push(s, "a", theta0, kind=PushKind.INIT)).committed
    for island in ("a", "b"):
        pull(s, island, -1)

    active, most, guard = [0], [0], threading.Lock()
    decoding, b_arrived, release = threading.Event(), threading.Event(), threading.Event()
    real = RoundAccumulator.add

    def slow_add(self, *args, **kwargs):  # a's decode holds on until b's commit has come, counting who runs at once
        with guard:
            active[0] += 1
            most[0] = max(most[0], active[0])
            first = not decoding.is_set()
        decoding.set()
        if first:
            release.wait(10)  # (b's commit comes while a's decode runs)
        else:
            b_arrived.set()  # b's decode: beside a's on the old code, after it on the new
        try:
            return real(self, *args, **kwargs)
        finally:
            with guard:
                active[0] -= 1

    class Watched(asyncio.Lock):
        async def acquire(self):
            if self.locked():  # b's commit waits for a's, which holds the core's lock
                b_arrived.set()
            return await super().acquire()

    monkeypatch.setattr(RoundAccumulator, "add", slow_add)
    s.lock = Watched()

    async def race():
        first = asyncio.create_task(push(s, "a", da, tokens=3))
        await asyncio.to_thread(decoding.wait)  # a's delta is being decoded, in its worker thread
        first.cancel()  # its call goes away
        second = asyncio.create_task(push(s, "b", db, tokens=1))
        await asyncio.to_thread(b_arrived.wait, 10)  # b waits for the lock, or (before) decodes beside a
        release.set()
        assert (await second).committed

    asyncio.run(race())
    assert most[0] == 1  # (before: b's decode ran beside a's, both writing the sum)
    assert sorted(s.accumulator.committed) == ["a", "b"]  # (before: a's delta was in the sum, its weight not)
    decision, reason = decide(s.clock(), view(s), s.policy())
    assert decision is Decision.CLOSE, reason
    asyncio.run(s.close_round(reason))
    for n in SHAPES:  # the token-weighted mean of both, then Nesterov from zero momentum
        g = (3 * da[n].numpy() + db[n].numpy()) / 4
        np.testing.assert_allclose(s.model.params[n].numpy(), theta0[n].numpy() - 0.7 * 1.9 * g, rtol=1e-6, atol=1e-6)
