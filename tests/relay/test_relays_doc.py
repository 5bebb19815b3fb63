"""docs/relays.md's commands, run as written on loopback: the root, a relay per region (three) and an
island behind each, real processes, two rounds of the bundled model. Ports, the state dir and the run's
length are swapped for a test's."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest
from support import collect_events, http, wait_for

DOC = Path(__file__).resolve().parents[2] / "docs" / "relays.md"

pytestmark = pytest.mark.slow  # real processes, tens of seconds each


def commands() -> dict[str, list[str]]:
    found = re.findall(r"<!-- relay: ([^>]+?) -->\n```sh\n(.*?)```", DOC.read_text(), re.S)
    return {what: shlex.split(text.replace("\\\n", " ")) for what, text in found}


def swap(args: list[str], **values: str) -> list[str]:
    """``args`` with each ``--flag``'s value replaced (``swap(args, port="0")``)."""
    out = list(args)
    for name, value in values.items():
        flag = "--" + name.replace("_", "-")
        out[out.index(flag) + 1] = value
    return out


def port_of(path: Path) -> str:
    return wait_for(lambda: path.exists() and path.read_text().strip(), timeout=60, what=f"{path.name}")


def test_three_regions_train_through_their_relays_as_the_guide_says(group):
    work = group.work_dir
    by = commands()
    assert list(by) == ["root", "relay eu", "island eu-1"]
    root = by["root"]
    assert root[:2] == ["atoll", "coordinator"]
    root = swap(root, host="127.0.0.1", port="0", state_dir=str(work / "state"), sync_every="4", total_rounds="2")
    group.start("root", [*root[1:], "--port-file", str(work / "root.port"), "--admin-port", "0",
                         "--admin-port-file", str(work / "admin.port")], cwd=work)  # fmt: skip
    root_port, admin = port_of(work / "root.port"), port_of(work / "admin.port")

    relay = by["relay eu"]
    assert relay[:2] == ["atoll", "relay"]
    islands = []
    for region in ("eu", "us", "asia"):
        args = swap(relay, upstream=f"localhost:{root_port}", relay_id=region, host="127.0.0.1", port="0")
        watch = ["--admin-port", "0", "--admin-port-file", str(work / f"{region}.admin")]  # the relay's own view
        group.start(f"relay-{region}", [*args[1:], "--port-file", str(work / f"{region}.port"), *watch], cwd=work)
        island = by["island eu-1"]
        assert island[:2] == ["atoll", "island"]
        island = swap(island, coordinator=f"localhost:{port_of(work / f'{region}.port')}", island_id=f"{region}-1")
        islands.append(group.start(f"{region}-1", island[1:], cwd=work))
    events = collect_events(islands, until=lambda ev: sum(e["event"] == "done" for e in ev) == 3, timeout=300)
    assert [p.wait(60) for p in islands] == [0, 0, 0]
    done = [e for e in events if e["event"] == "done"]
    assert all(e["run_complete"] and e["round"] == 2 for e in done), done
    final = [e["digest"] for e in events if e["event"] == "round" and e["now_round"] == 2]
    assert len(final) == 3 and len(set(final)) == 1, final  # three islands behind three relays hold one θ

    status, body = http(f"http://127.0.0.1:{admin}/api/status")
    assert status == 200, body
    history = json.loads(body)["history"]
    assert [h["islands"] for h in history] == [["asia", "eu", "us"]] * 2
    assert set(history[-1]["tokens_by_island"]) == {"asia/asia-1", "eu/eu-1", "us/us-1"}
    rows = {row["island"]: row for row in json.loads(body)["islands"]}
    behind = rows["eu"]["behind"]
    assert rows["eu"]["relay"] and list(behind) == ["eu/eu-1"]
    assert behind["eu/eu-1"]["rounds"] == 2 and behind["eu/eu-1"]["inner_steps"] == 2 * 4  # H=4, two rounds
    assert behind["eu/eu-1"]["tokens"] == sum(h["tokens_by_island"]["eu/eu-1"] for h in history)
    assert behind["eu/eu-1"]["last_round_tokens"] == history[-1]["tokens_by_island"]["eu/eu-1"]
    metrics = http(f"http://127.0.0.1:{admin}/metrics")[1]
    assert f'atoll_relayed_island_tokens{{island="eu/eu-1"}} {float(behind["eu/eu-1"]["last_round_tokens"])}' in metrics

    relay_status = json.loads(http(f"http://127.0.0.1:{port_of(work / 'eu.admin')}/api/status")[1])
    assert [row["island"] for row in relay_status["islands"]] == ["eu-1"]
    assert relay_status["round"] == 2 and relay_status["run"]["run_id"] == "llm-1"  # the root's run, as served
