"""The dashboard page rendered by headless Chromium (Debian's chromium; .ci/run installs it)."""

import re
import shutil
import subprocess

import pytest
import torch

from atoll.coordinator import RunConfig
from atoll.protos import coordinator_pb2 as pb

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
SHAPES = {"w": (4, 3)}


def render(url: str, profile, screenshot=None) -> str:
    flags = [
        CHROMIUM,
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        f"--user-data-dir={profile}",
        "--virtual-time-budget=4000",
        "--window-size=1200,900",
    ]
    if screenshot:
        subprocess.run([*flags, f"--screenshot={screenshot}", url], capture_output=True, timeout=60, check=True)
    out = subprocess.run([*flags, "--dump-dom", url], capture_output=True, text=True, timeout=60, check=True)
    return out.stdout


@pytest.mark.skipif(CHROMIUM is None, reason="needs Debian's chromium (apt-get install chromium; .ci/run does)")
def test_dashboard_renders_live_charts_and_timeline(start_server, raw_island, tmp_path):
    srv = start_server(
        RunConfig(run_id="dash", sync_every=1, quorum=1, round_deadline_seconds=0.3), admin_port=0, admin_token="tok"
    )
    a, b = raw_island(srv.address, "a", SHAPES, run_id="dash"), raw_island(srv.address, "b<i>", SHAPES, run_id="dash")
    a.join()
    b.join()
    a.push({"w": torch.randn(4, 3)}, round_=0, kind=pb.PUSH_KIND_INIT)
    for r in range(3):
        a.push({"w": torch.randn(4, 3)}, round_=r, tokens=10, loss=3.0 - r)
        if r != 1:  # b misses round 1: the round closes at the deadline without it
            b.push({"w": torch.randn(4, 3)}, round_=r, tokens=10, loss=3.0 - r)
        a.pull(r)
    base = srv.server.admin.address
    dom = render(f"{base}/dashboard?token=tok", tmp_path / "profile", screenshot=tmp_path / "dash.png")
    assert '<b id="round">3</b>' in dom
    loss_svg = re.search(r'<svg id="loss-chart".*?</svg>', dom, re.S).group(0)
    assert loss_svg.count('class="point"') == 3 and 'class="series"' in loss_svg
    bytes_svg = re.search(r'<svg id="bytes-chart".*?</svg>', dom, re.S).group(0)
    assert bytes_svg.count('class="point"') == 3
    row_b = re.search(r'<tr data-island="b&lt;i&gt;">(.*?)</tr>', dom, re.S).group(1)  # escaped, not injected
    assert re.findall(r'class="cell (\w+)"', row_b) == ["committed", "missing", "committed"]
    assert (tmp_path / "dash.png").stat().st_size > 10_000
    # Without the token the page is refused.
    assert "missing or wrong bearer token" in render(f"{base}/dashboard", tmp_path / "profile2")
