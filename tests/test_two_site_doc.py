"""docs/two-site-run.md's planning and TLS commands, run as written on loopback (names and ports swapped
for loopback's, a run cut to a few rounds of the bundled model)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import urllib.request
from pathlib import Path

from conftest import collect_events, wait_for

DOC = Path(__file__).resolve().parents[1] / "docs" / "two-site-run.md"
ENV = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
"""`atoll` on the PATH, as after the README's install."""


def blocks() -> list[tuple[str, str]]:
    """The doc's commands a test runs: (what, text), in order."""
    return re.findall(r"<!-- test: ([^>]+?) -->\n```sh\n(.*?)```", DOC.read_text(), re.S)


def argv(command: str, cwd: Path) -> list[str]:
    """A command of the doc as bash would run it in ``cwd`` (its quoting, $(...) and $COORD_HOST)."""
    out = subprocess.run(
        ["bash", "-c", f'export COORD_HOST=localhost; set -- {command.strip()}; printf "%s\\0" "$@"'],
        cwd=cwd,
        capture_output=True,
        text=True,
        check=True,
        env=ENV,
    )
    return out.stdout.split("\0")[:-1]


def test_the_two_site_guide_runs_as_written(group):
    work = group.work_dir
    found = blocks()
    assert [w for w, _ in found] == ["run", "run", "coordinator", "island site-a", "status"]
    for what, text in found:
        if what != "run":
            continue
        script = text.replace("export COORD_HOST=coord.example.org", "export COORD_HOST=localhost")
        out = subprocess.run(
            ["bash", "-euo", "pipefail", "-c", script], cwd=work, capture_output=True, text=True, env=ENV
        )
        assert out.returncode == 0, out.stderr
        if "atoll plan" in script:
            assert "<- recommended" in out.stdout
    assert all((work / f).exists() for f in ("ca.pem", "coord.pem", "site-a.pem", "site-b.key", "tokens.json"))
    # A URL-safe token begins with '-' one time in 64 (and a flag's value that does looked like a flag):
    # these runs' do, always.
    assert json.loads((work / "tokens.json").read_text()).keys() == {"site-a", "site-b"}
    (work / "tokens.json").write_text(json.dumps({"site-a": "-a-token", "site-b": "--b-token"}))
    (work / "admin.token").write_text("-admin-token\n")

    (_, coord_cmd), (_, island_cmd), (_, status_cmd) = [b for b in found if b[0] != "run"]
    coord_args = argv(coord_cmd, work)
    assert coord_args[:2] == ["atoll", "coordinator"] and "--tls-client-ca" in coord_args
    ports = {"port": work / "port", "admin": work / "admin.port"}
    coord = group.start(
        "coordinator",
        [*coord_args[1:], "--host", "127.0.0.1", "--port", "0", "--bulk-port", "0", "--admin-port", "0",
         "--state-dir", str(work / "state"), "--port-file", str(ports["port"]), "--admin-port-file",
         str(ports["admin"]), "--sync-every", "5", "--quorum", "2", "--total-rounds", "2"],
        cwd=work,
    )  # fmt: skip
    wait_for(lambda: ports["port"].exists() and ports["admin"].exists(), timeout=60, what="the coordinator's ports")
    port, admin = ports["port"].read_text().strip(), ports["admin"].read_text().strip()
    islands = []
    for site in ("site-a", "site-b"):
        args = argv(island_cmd.replace("site-a", site), work)
        assert args[:2] == ["atoll", "island"] and "--tls-cert" in args and "--token" in args
        islands.append(
            group.start(site, [*args[1:], "--coordinator", f"localhost:{port}", "--inner-lr", "3e-3"], cwd=work)
        )
    collect_events(islands, until=lambda ev: sum(e["event"] == "done" for e in ev) == 2, timeout=240)
    assert [p.wait(60) for p in islands] == [0, 0]

    status = argv(status_cmd.replace("9090", admin), work)
    out = subprocess.run([sys.executable, "-m", "atoll", *status[1:]], cwd=work, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert "site-a" in out.stdout and "site-b" in out.stdout
    token = (work / "admin.token").read_text().strip()
    request = urllib.request.Request(f"http://127.0.0.1:{admin}/metrics", headers={"Authorization": f"Bearer {token}"})
    with urllib.request.urlopen(request, timeout=30) as resp:
        metrics = resp.read().decode()
    bulk = re.search(r"^atoll_bulk_calls_total (\d+)", metrics, re.M)
    assert bulk and int(bulk.group(1)) >= 6, metrics[:2000]  # θ_0, the pushes and pulls went on the TLS bulk port
    coord.stop()
