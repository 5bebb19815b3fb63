"""An island with its coordinator gone keeps its exit promises (hardening round 5, items 14 and 15):
SIGTERM while it retries a push is exit 143 within 15 s (it was still running 100 s later), and giving
up on a lost coordinator is one line naming every address it was given (it was a 40-line traceback
naming the first)."""

from __future__ import annotations

import signal
import time

import pytest
from support import collect_events, coordinator_flags, island_flags, wait_for

from atoll.harness.seaweed import free_ports

pytestmark = pytest.mark.slow


def island_retrying_a_push(group, tmp_path, extra=()):
    """A coordinator, one island past its first round, then the coordinator SIGKILLed: the island's next
    push retries. (The island, the standby address it was given.)"""
    port, standby = free_ports(2)
    coord, address = group.start_coordinator(
        tmp_path / "state", [*coordinator_flags(sync_every=10, quorum=1), "--bulk-port", "-1"], port=port
    )
    both = f"{address}|127.0.0.1:{standby}"
    island = group.start("island", island_flags(both, "island", rounds=None, extra=extra))
    collect_events([island], until=lambda ev: any(e["event"] == "round" for e in ev), timeout=120)
    coord.signal(signal.SIGKILL)
    coord.wait(10)
    return island, both


def test_sigterm_while_retrying_a_push_exits_143_within_15_seconds(group, tmp_path):
    island, _ = island_retrying_a_push(group, tmp_path, extra=["--checkpoint-dir", str(tmp_path / "ckpt")])
    # (until the island says it retries: the state the issue is about)
    wait_for(lambda: "unreachable" in island.log_tail(20_000), timeout=60, what="the island to retry its push")
    island.signal(signal.SIGTERM)
    termed = time.monotonic()
    assert island.wait(30) == 143
    assert time.monotonic() - termed < 15.0
    log = island.log_tail(100_000)
    assert "Traceback" not in log, log[-3000:]


def test_giving_up_on_a_lost_coordinator_is_one_line_naming_every_address(group, tmp_path):
    island, both = island_retrying_a_push(group, tmp_path, extra=["--give-up-seconds", "4"])
    assert island.wait(120) == 1
    log = island.log_tail(100_000)
    assert "Traceback" not in log and "_MultiThreadedRendezvous" not in log, log[-3000:]
    first, second = both.split("|")
    line = next(ln for ln in log.splitlines() if "atoll island: error:" in ln)
    assert f"coordinator {first} | {second} unreachable" in line and "giving up" in line, line
