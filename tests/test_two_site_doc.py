"""docs/two-site-run.md's commands, run as written on loopback (names and ports swapped for loopback's,
a run cut to a few rounds of the bundled model), in the order of the guide and in one shell's
environment: what a block exports, the blocks after it see."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import urllib.request
from pathlib import Path

from support import collect_events, http, wait_for
from support.shell import Shell, blocks


def flag(args: list[str], name: str) -> str:
    return args[args.index(name) + 1]


def test_the_two_site_guide_runs_as_written(group):
    work = group.work_dir
    shell = Shell(work)
    found = blocks()
    order = ["run", "coordinator plain", "run", "coordinator", "island site-a", "status", "evict"]
    assert [w for w, _ in found] == order
    by = dict(found[1:2] + found[3:])
    plan, certs = found[0][1], found[2][1]

    out = shell.run(plan)  # step 0
    assert out.returncode == 0 and "<- recommended" in out.stdout, out.stderr

    # step 1, as written: the admin token it makes in $ADMIN_TOKEN guards the admin port
    args = shell.argv(by["coordinator plain"])
    token = shell.value("ADMIN_TOKEN")
    assert args[:2] == ["atoll", "coordinator"] and flag(args, "--admin-token") == token and len(token) > 30
    plain = start(group, work, "plain", args, "--state-dir", str(work / "plain-state"))
    base = f"http://127.0.0.1:{plain['admin']}"
    assert http(base + "/healthz")[0] == 200 and http(base + "/api/status")[0] == 401
    assert http(base + "/api/status", token=token)[0] == 200
    plain["proc"].stop()

    out = shell.run(certs.replace("export COORD_HOST=coord.example.org", "export COORD_HOST=localhost"))  # 1b
    assert out.returncode == 0, out.stderr
    assert all((work / f).exists() for f in ("ca.pem", "coord.pem", "site-a.pem", "site-b.key", "tokens.json"))
    # A URL-safe token begins with '-' one time in 64 (and a flag's value that does looked like a flag):
    # these runs' do, always.
    assert json.loads((work / "tokens.json").read_text()).keys() == {"site-a", "site-b"}
    (work / "tokens.json").write_text(json.dumps({"site-a": "-a-token", "site-b": "--b-token"}))
    (work / "admin.token").write_text("-admin-token\n")

    coord_args = shell.argv(by["coordinator"])
    assert coord_args[:2] == ["atoll", "coordinator"] and "--tls-client-ca" in coord_args
    assert flag(coord_args, "--admin-token") == "-admin-token"
    assert set(args[2:]) - {token} <= set(coord_args)  # step 1's command, with flags added
    coord = start(group, work, "coordinator", coord_args, "--state-dir", str(work / "state"), "--quorum", "2")
    islands = []
    for site in ("site-a", "site-b"):
        island_args = shell.argv(by["island site-a"].replace("site-a", site))
        assert island_args[:2] == ["atoll", "island"] and "--tls-cert" in island_args and "--token" in island_args
        islands.append(group.start(site, [*island_args[1:], "--coordinator", f"localhost:{coord['port']}",
                                          "--inner-lr", "3e-3"], cwd=work))  # fmt: skip
    collect_events(islands, until=lambda ev: sum(e["event"] == "done" for e in ev) == 2, timeout=240)
    assert [p.wait(60) for p in islands] == [0, 0]

    status = shell.argv(by["status"].replace("9090", coord["admin"]))
    out = subprocess.run([sys.executable, "-m", "atoll", *status[1:]], cwd=work, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert "site-a" in out.stdout and "site-b" in out.stdout
    request = urllib.request.Request(
        f"http://127.0.0.1:{coord['admin']}/metrics", headers={"Authorization": "Bearer -admin-token"}
    )
    with urllib.request.urlopen(request, timeout=30) as resp:
        metrics = resp.read().decode()
    bulk = re.search(r"^atoll_bulk_calls_total (\d+)", metrics, re.M)
    assert bulk and int(bulk.group(1)) >= 6, metrics[:2000]  # θ_0, the pushes and pulls went on the TLS bulk port

    out = shell.run(by["evict"].replace("localhost:9090", f"localhost:{coord['admin']}"))  # step 4's calls
    assert out.returncode == 0, out.stderr
    assert '"evicted": "site-b"' in out.stdout and '"quorum: 2 -> 1"' in out.stdout, out.stdout
    status = json.loads(http(f"http://127.0.0.1:{coord['admin']}/api/status", token="-admin-token")[1])
    assert status["run"]["quorum"] == 1
    coord["proc"].stop()


def start(group, work: Path, name: str, args: list[str], *swap: str) -> dict:
    """``atoll coordinator`` from the guide's ``args`` on loopback: ports 0 (reported in files), the
    run cut to 2 rounds of H=5, and ``swap``'s flags in place of the guide's."""
    ports = {"port": work / f"{name}.port", "admin": work / f"{name}.admin.port"}
    for p in ports.values():
        p.unlink(missing_ok=True)
    proc = group.start(
        name,
        [*args[1:], "--host", "127.0.0.1", "--port", "0", "--bulk-port", "0", "--admin-port", "0",
         "--port-file", str(ports["port"]), "--admin-port-file", str(ports["admin"]), "--sync-every", "5",
         "--total-rounds", "2", *swap],
        cwd=work,
    )  # fmt: skip
    wait_for(lambda: all(p.exists() for p in ports.values()), timeout=60, what=f"{name}'s ports")
    return {"proc": proc, **{k: p.read_text().strip() for k, p in ports.items()}}
