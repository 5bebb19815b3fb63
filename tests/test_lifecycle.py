"""Start and stop: DiLoCo.start() keeps the island alive while θ_0 is on its way; the
coordinator's waits give way to a cancellation (its stop)."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import torch

from atoll.coordinator import RunConfig
from atoll.coordinator.core import wait_event
from atoll.coordinator.membership import IslandState, island_state
from atoll.islands import DiLoCo
from atoll.protos import coordinator_pb2 as pb


def test_island_waiting_for_theta0_keeps_its_lease(start_server, raw_island):
    """Island "boot" joins first (so it bootstraps) and takes three leases to upload θ_0. The
    DiLoCo island that joined meanwhile waits in start() on a pull longer than the lease; its
    heartbeats must keep it alive (not "gone", which the round would not wait for), and it must
    start from exactly the θ_0 that was uploaded."""
    lease = 1.0
    srv = start_server(RunConfig(run_id="t", sync_every=4, lease_seconds=lease))
    torch.manual_seed(0)
    model = torch.nn.Linear(6, 3)
    theta0 = {n: torch.randn_like(p) for n, p in model.named_parameters()}
    sync = DiLoCo(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        coordinator=srv.address,
        island_id="waiter",
        run_id="t",
        heartbeat_seconds=0.1,
        pull_wait_seconds=30.0,  # one pull for the whole wait: only heartbeats renew the lease
    )
    boot = raw_island(srv.address, "boot", {n: tuple(t.shape) for n, t in theta0.items()})
    assert boot.join().bootstrap
    uploaded = threading.Event()

    def keep_boot_alive():  # boot stays the bootstrapper only while its lease holds
        beat = pb.HeartbeatRequest(run_id="t", island_id="boot", round=-1)
        while not uploaded.wait(lease / 10):
            boot.client.heartbeat(beat)

    errors: list[BaseException] = []

    def start():
        try:
            sync.start()
        except BaseException as err:  # reported by the test thread
            errors.append(err)

    threads = [threading.Thread(target=keep_boot_alive), threading.Thread(target=start)]
    for t in threads:
        t.start()
    try:
        deadline = time.monotonic() + 10
        while "waiter" not in srv.inspect(lambda s: s.membership.islands):
            assert time.monotonic() < deadline, "the island never joined"
            time.sleep(0.01)
        states = []
        for _ in range(30):  # 3 leases
            states.append(srv.inspect(lambda s: island_state(s.membership.islands["waiter"], s.clock(), s.round)))
            time.sleep(lease / 10)
        assert threads[1].is_alive(), f"start() returned before θ_0 existed: {errors}"
        assert set(states) == {IslandState.JOINING}, states
        boot.push(theta0, round_=0, kind=pb.PUSH_KIND_INIT)
        threads[1].join(15)
        assert not threads[1].is_alive() and not errors, errors
        for n, p in model.named_parameters():
            assert torch.equal(p.detach(), theta0[n]), n
    finally:
        uploaded.set()
        for t in threads:
            t.join(15)
        sync.close()


def test_wait_event_is_cancelled_even_when_the_event_fires_in_the_same_iteration():
    """The decider and the pull long-poll wait on events; the server's stop cancels them. A
    cancellation that lands together with the event must still cancel (``asyncio.wait_for``
    swallowed it before Python 3.12, so the decider ran on and stop hung)."""

    async def scenario():
        event = asyncio.Event()
        task = asyncio.create_task(wait_event(event, 10.0))
        for _ in range(3):
            await asyncio.sleep(0)  # the task is waiting
        event.set()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        # Timeouts and a set event still answer as before.
        assert await wait_event(event, 0.0) is True
        t = time.monotonic()
        assert await wait_event(asyncio.Event(), 0.05) is False
        assert time.monotonic() - t >= 0.04

    asyncio.run(scenario())
