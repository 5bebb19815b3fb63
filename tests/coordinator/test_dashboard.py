"""The dashboard page rendered by headless Chromium (Debian's chromium; .ci/run installs it)."""

import re
import shutil
import subprocess

import pytest
import torch
from support import exact_config

from atoll.coordinator.options import AdminOptions
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


LOSS_BLUE, BYTES_GREEN = (0x3B, 0x82, 0xF6), (0x10, 0xB9, 0x81)
"""The loss and bytes charts' series colours (dashboard.html)."""


def painted(png, rgb: tuple[int, int, int]) -> int:
    """Pixels of the screenshot in ``rgb`` (within anti-aliasing's reach): a chart that was drawn."""
    from PIL import Image

    img = Image.open(png).convert("RGB")
    return sum(
        n for n, c in img.getcolors(maxcolors=1 << 22) if max(abs(a - b) for a, b in zip(c, rgb, strict=True)) <= 12
    )


def test_painted_counts_only_the_colour(tmp_path):
    from PIL import Image

    img = Image.new("RGB", (10, 10), (250, 251, 252))
    img.paste(LOSS_BLUE, (0, 0, 4, 5))
    img.save(tmp_path / "x.png")
    assert painted(tmp_path / "x.png", LOSS_BLUE) == 20 and painted(tmp_path / "x.png", BYTES_GREEN) == 0


@pytest.mark.skipif(CHROMIUM is None, reason="needs Debian's chromium (apt-get install chromium; .ci/run does)")
def test_dashboard_renders_live_charts_and_timeline(start_server, raw_island, tmp_path):
    srv = start_server(
        exact_config(
            run_id="dash",
            sync_every=1,
            quorum=1,
            round_deadline_seconds=0.3,
        ),
        admin=AdminOptions(port=0, token="tok"),
    )
    a, b = raw_island(srv.address, "a", SHAPES, run_id="dash"), raw_island(srv.address, "b<i>", SHAPES, run_id="dash")
    a.join()
    b.join()
    a.push({"w": torch.randn(4, 3)}, round_=0, kind=pb.PUSH_KIND_INIT)
    for r in range(3):
        a.push({"w": torch.randn(4, 3)}, round_=r, tokens=10, loss=3.0 - r, compute_seconds=1e6)  # always busy
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
    # Goodput: a reports more compute than wall time (capped at 100%), b none; the run's is all of a's.
    assert '<b id="goodput">100%</b>' in dom
    row_a = re.search(r"<tr><td>a</td>(.*?)</tr>", dom, re.S).group(1)
    assert re.search(r'<td class="goodput">100%</td>', row_a) and row_a.endswith("<td>30</td>")  # 30 tokens in θ
    row_b = re.search(r"<tr><td>b&lt;i&gt;</td>(.*?)</tr>", dom, re.S).group(1)
    assert re.search(r'<td class="goodput">0%</td>', row_b) and row_b.endswith("<td>20</td>")
    assert painted(tmp_path / "dash.png", LOSS_BLUE) > 50 and painted(tmp_path / "dash.png", BYTES_GREEN) > 50
    # Without the token the page is refused.
    assert "missing or wrong bearer token" in render(f"{base}/dashboard", tmp_path / "profile2")


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.skipif(CHROMIUM is None, reason="needs Debian's chromium (apt-get install chromium; .ci/run does)")
def test_dashboard_after_a_two_island_run(group, tmp_path):
    """Two real islands train four rounds and leave. The page shows the run's config, human units,
    throughput, and the islands that left, with their state. ``ATOLL_DASHBOARD_PNG=docs/dashboard.png``
    also writes the screenshot there (the picture in the README)."""
    import os
    import shutil

    from support import collect_events, coordinator_flags, island_flags

    admin_file = tmp_path / "admin.port"
    coord, address = group.start_coordinator(
        tmp_path / "state",
        coordinator_flags(
            sync_every=20,
            quorum=2,
            extra=["--admin-port", "0", "--admin-port-file", str(admin_file), "--admin-token", "tok"],
        ),
    )
    islands = [group.start(f"site-{k}", island_flags(address, f"site-{k}", rounds=4)) for k in "ab"]
    collect_events(islands, until=lambda ev: sum(e["event"] == "done" for e in ev) == 2, timeout=180)
    assert [p.wait(30) for p in islands] == [0, 0]
    base = f"http://127.0.0.1:{admin_file.read_text().strip()}"
    shot = tmp_path / "dashboard.png"
    dom = render(f"{base}/?token=tok", tmp_path / "profile", screenshot=shot)
    coord.stop()
    assert '<b id="round">4</b>' in dom
    config = re.search(r'<div class="config" id="config">(.*?)</div>', dom, re.S).group(1)
    assert "H <b>20</b>" in config and "codec <b>identity</b>" in config and "quorum <b>2</b>" in config
    bytes_svg = re.search(r'<svg id="bytes-chart".*?</svg>', dom, re.S).group(0)
    assert re.search(r'class="label">[0-9.]+ (KB|MB)<', bytes_svg), bytes_svg  # not 2.488e+5
    rate_svg = re.search(r'<svg id="rate-chart".*?</svg>', dom, re.S).group(0)
    assert rate_svg.count('class="point"') == 4
    rows = re.findall(r'<tr><td>(site-\w)</td><td class="state-(\w+)">', dom)
    assert rows == [("site-a", "left"), ("site-b", "left")]
    committed = re.findall(r'<tr><td>site-\w</td><td class="state-left">left</td><td>[^<]*</td><td>(\d+)</td>', dom)
    assert committed == ["4", "4"], dom  # what an island that left did stays in the table
    assert painted(shot, LOSS_BLUE) > 50 and painted(shot, BYTES_GREEN) > 50
    if os.environ.get("ATOLL_DASHBOARD_PNG"):
        shutil.copy(shot, os.environ["ATOLL_DASHBOARD_PNG"])
