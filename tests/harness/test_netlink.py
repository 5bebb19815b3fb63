"""The WAN emulator: TCP across it sees the round trip and the rate it was set to."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from atoll.harness.netlink import LinkSpec

ROOT = Path(__file__).resolve().parents[2]


def namespaces_work() -> bool:
    if any(shutil.which(tool) is None for tool in ("unshare", "nsenter", "ip", "tc", "sysctl")):
        return False
    try:
        return subprocess.run(["unshare", "-rn", "true"], capture_output=True, timeout=10).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


@pytest.mark.skipif(not namespaces_work() or not Path("/dev/net/tun").exists(), reason="no user namespaces or TUN")
def test_tcp_across_the_emulated_link_sees_its_round_trip_and_rate():
    out = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "netlink_check.py"), "--links", "40:60", "--seconds", "3"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["ping_rtt_min_ms"] >= 0.98 * 60 and got["ping_rtt_ms"] <= 1.05 * 60, got
    assert 0.90 * 40 <= got["steady_mbit"] <= 1.01 * 40, got  # the packets' headers are the rest
    assert got["bytes"] == int(40e6 / 8 * 3)


def test_link_specs_are_checked():
    for bad in (dict(rate_mbit=0, rtt_ms=10), dict(rate_mbit=10, rtt_ms=-1), dict(rate_mbit=10, rtt_ms=1, loss=1.0)):
        with pytest.raises(ValueError):
            LinkSpec(**bad)
    assert LinkSpec(rate_mbit=100, rtt_ms=100).bdp_bytes == 1_250_000
