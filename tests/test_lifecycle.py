"""DiLoCo.start() against a real coordinator: the island stays alive while θ_0 is on its way."""

from __future__ import annotations

import threading
import time

import torch

from atoll.coordinator import RunConfig
from atoll.coordinator.core import IslandState, island_state
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
        while "waiter" not in srv.inspect(lambda s: s.islands):
            assert time.monotonic() < deadline, "the island never joined"
            time.sleep(0.01)
        states = []
        for _ in range(30):  # 3 leases
            states.append(srv.inspect(lambda s: island_state(s.islands["waiter"], s.clock(), s.round)))
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
