"""Compute utilisation at 124M over an emulated WAN, islands replaying an accelerator's step time.

    python benchmarks/wan_utilisation.py [--link 100:100] [--islands 2] [--step-seconds 0.1]
        [--sync-every 100] [--rounds 4] [--codec int8] [--overlap 0 30] [--fragments 1] [--tls]
    python benchmarks/wan_utilisation.py --replan LOG    # today's planner against earlier runs' JSON lines

Runs itself under ``unshare -rn``. Each island is a process in a network namespace of its own,
joined to the coordinator's by its own emulated link (:mod:`atoll.harness.netlink`, ``RATE:RTT``,
the hosts' TCP buffers at the kernel's defaults). An island holds the real gpt-125m in fp32 and the
real DiLoCo wrapper (its pushes, pulls, codecs, overlap and streaming fragments); its inner step is
replayed: it sleeps ``--step-seconds`` (an accelerator's step, the host idle meanwhile) and nudges
one parameter so that every round has a pseudo-gradient to send; once a round it also scales every
parameter by 1 + 1e-4 (inside that step's time), so that pseudo-gradients and the coordinator's sums
are dense, as training makes them (a top-k's cost depends on it). The coordinator's update goes in
``atoll plan``'s downlink for the codec (:func:`atoll.plan.downlink_for`: sparse for sparse pushes),
with error feedback on the islands for the codecs that drop values (sparse, top-k); ``--tls``: the
coordinator serves TLS (a self-signed certificate the islands take as their CA). Utilisation = the
steps' replayed time / the wall time, over the rounds after the first ``--warmup`` (θ_0's upload and
download, and the islands falling into step: the one that uploaded θ_0 waits once for the others, at
its first merge when overlapping) and before the last (drained at the end), all islands together.
Beside each measured figure, what ``atoll plan`` predicts for the same settings: as for an
accelerator island (no host work), and with the host work these CPU islands do each round
(``--host-seconds``), timed here first on one thread (the pseudo-gradient, its encoding, the
update's decoding and its apply at 124M) and as the islands' ``RoundStats.host_seconds`` report it
in the run (the mean over the measured rounds). And where a measured round's time beyond its steps
went, by the step it was lost at (:func:`where_lost`): the launch (the pseudo-gradient and its
encoding, on the training thread), the merge (waiting for the exchange, then the update's decoding
and apply) and every other step together (anything the exchange's thread, the coordinator or the
delay lines took from the training thread). And the exchange beside the planner's ``sync_seconds``:
its time on the link and at the coordinator as the islands measure it
(``RoundStats.exchange_seconds``; in a plain exchange the island's work that streams with the
transfers is left out of it, so the islands' whole sync is given against the planner's stall too),
and the coordinator's own part of each round from its history (:func:`coordinator_split`).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from contextlib import ExitStack
from pathlib import Path

import common  # the repository and benchmarks/ on the path (benchmarks/common.py)

from atoll.compression import get_codec
from atoll.harness.netlink import Link, LinkSpec, enter_namespace
from atoll.plan import downlink_for

ROOT = common.ROOT


def island(addresses: str, name: str, a) -> None:
    """One island (run in its namespace): prints a JSON line with its step times."""
    import torch

    from atoll.islands import ClientTls, CoordinatorLink, DiLoCo, RetryPolicy
    from atoll.models import TinyGPT, preset

    torch.set_num_threads(1)
    model = TinyGPT(preset("gpt-125m", vocab_size=50257))
    tls = ClientTls(ca=a.tls_ca) if a.tls_ca else None
    link = CoordinatorLink(addresses, run_id="u", island_id=name, retry=RetryPolicy(give_up_seconds=600), tls=tls)
    params = list(model.parameters())
    marks, host, slow = [], [], []
    with DiLoCo(model, link, overlap_steps=a.overlap_steps, streaming=a.fragments > 1) as sync:
        for step in range(a.rounds * a.sync_every):
            marks.append((time.perf_counter(), sync.round))
            began = time.perf_counter()
            with torch.no_grad():  # every parameter moves once a round: a dense pseudo-gradient, as training
                if a.dense and step % a.sync_every == a.sync_every - 1:  # gives (a top-k's cost depends on it)
                    torch._foreach_mul_(params, 1 + 1e-4)
                params[0].view(-1)[step % 64] += 1e-3
            time.sleep(max(0.0, a.step_seconds - (time.perf_counter() - began)))  # the accelerator's step
            began = time.perf_counter()
            stats = sync.step(tokens=16384, loss=1.0)
            if time.perf_counter() - began > 0.5:  # where a long step went (--dump)
                slow.append((step, round(time.perf_counter() - began, 3), stats and stats.sync_seconds))
            if stats is not None:  # its own work in the exchange, and the exchange on the link and coordinator
                host.append((stats.round, stats.host_seconds, stats.exchange_seconds, stats.sync_seconds,
                             stats.background_seconds))  # fmt: skip
        marks.append((time.perf_counter(), sync.round))
        sync.drain()
    print(json.dumps({"island": name, "marks": marks, "host": host, "slow": slow}), flush=True)


def warmup(a, overlap: int) -> int:
    """Rounds left out at the start: θ_0's round, and with overlap also the next, which holds round 0's
    merge. The island that uploaded θ_0 starts training while the others still download it (at 124M
    over 100 Mbit/s, ~40 s), and its first merge waits for them all: that wait, not a steady round's,
    was the 11-16 s "stall at the merge" of one island in every earlier τ=15 run."""
    return a.warmup if a.warmup is not None else (2 if overlap else 1)


def measure(a, overlap: int) -> dict:
    rate, rtt = (float(x) for x in a.link.split(":"))
    spec = LinkSpec(rate_mbit=rate, rtt_ms=rtt, tuned_buffers=False)
    with tempfile.TemporaryDirectory(prefix="util-") as tmp, ExitStack() as stack:
        links = [stack.enter_context(Link(spec, index=i)) for i in range(a.relays or a.islands)]
        port_file = Path(tmp) / "port"
        flags = [
            "--host", "0.0.0.0", "--port", "0", "--port-file", str(port_file), "--state-dir", str(Path(tmp) / "s"),
            "--run-id", "u", "--sync-every", str(a.sync_every), "--quorum", str(a.islands), "--codec", a.codec,
            "--downlink-codec", downlink_for(a.codec), "--round-deadline-seconds", "900",
            "--log-level", "WARNING", "--threads", "1",
        ]  # fmt: skip
        if get_codec(a.codec).drops_values:  # what it does not send is carried, not lost
            flags += ["--error-feedback"]
        ca = ""
        if a.tls:
            from wire import certificate  # benchmarks/wire.py, beside this script

            cert, key = certificate(Path(tmp), *(link.coordinator_host for link in links))
            flags += ["--tls-cert", str(cert), "--tls-key", str(key)]
            ca = str(cert)
        flags += ["--admin-port", "0", "--admin-port-file", str(Path(tmp) / "admin")]
        if a.fragments > 1:
            flags += ["--fragments", str(a.fragments)]
        coord = subprocess.Popen([sys.executable, "-m", "atoll", "coordinator", *flags], cwd=ROOT)
        procs, helpers = [], []
        try:
            while not port_file.exists():
                if coord.poll() is not None:
                    raise RuntimeError("the coordinator exited")
                time.sleep(0.1)
            time.sleep(0.5)
            ports = [p.split(":")[-1] for p in port_file.read_text().strip().split(",")]
            relays = [start_relay(link, k, ports, Path(tmp), ca) for k, link in enumerate(links)] if a.relays else []
            helpers += [proc for proc, _ in relays]
            for i in range(a.islands):
                link = links[i % len(links)]
                if relays:  # beside its relay, in the relay's site (its namespace's loopback)
                    addresses, island_ca = relays[i % len(relays)][1], ""
                else:
                    addresses, island_ca = ",".join(f"{link.coordinator_host}:{p}" for p in ports), ca
                cmd = [sys.executable, str(Path(__file__).resolve()), "--island", addresses, f"site-{i}",
                       "--overlap-steps", str(overlap), *island_flags(a), "--tls-ca", island_ca]  # fmt: skip
                procs.append(subprocess.Popen(link.site_command(cmd), stdout=subprocess.PIPE, text=True, cwd=ROOT))
            outs = [p.communicate(timeout=3600)[0] for p in procs]
            if a.dump:
                for i, out in enumerate(outs):
                    (a.dump / f"tau{overlap}-site-{i}.json").write_text(out)
            if any(p.returncode for p in procs):
                raise RuntimeError(f"an island failed: {[p.returncode for p in procs]}")
            admin = int((Path(tmp) / "admin").read_text())
            with urllib.request.urlopen(f"http://127.0.0.1:{admin}/api/status", timeout=30) as resp:
                served = json.loads(resp.read())["history"]  # (fragment 0's: the admin server shows it)
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
            for p in helpers:  # relays: stopped, so that they remove their state dirs
                p.terminate()
            for p in helpers:
                try:
                    p.wait(30)
                except subprocess.TimeoutExpired:
                    p.kill()
            coord.terminate()
            coord.wait(30)
        from atoll.coordinator.disk import snapshots

        state = Path(tmp) / "s"  # (streaming: a coordinator of each fragment, its own round after round)
        dirs = [state / f"fragment-{i}" for i in range(a.fragments)] if a.fragments > 1 else [state]
        history = [h for d in dirs for h in snapshots.load(d).history]
    written = {h["round"]: h for h in served}  # a record's write and publish are timed after it is logged
    for h in history:
        h.update({k: written.get(h["round"], {}).get(k, 0.0) for k in ("persist_seconds", "publish_seconds")})
    utils, lost, host, exchange, blocked, per_exchange, background = [], [], [], [], [], [], []
    for out in outs:
        got = json.loads(out.strip().splitlines()[-1])
        marks = got["marks"]
        per_round = {}  # (streaming: each fragment's exchange reports its own part of the round)
        for r, *seconds in got["host"]:
            per_round[r] = [x + y for x, y in zip(per_round.get(r, (0.0,) * 4), seconds, strict=True)]
        measured = [v for r, v in per_round.items() if warmup(a, overlap) <= r < a.rounds - 1]
        host += [own for own, _, _, _ in measured]
        exchange += [on_link for _, on_link, _, _ in measured]
        per_exchange.append(round(statistics.mean(on_link for _, on_link, _, _ in measured), 3) if measured else 0.0)
        blocked += [sync for _, _, sync, _ in measured]
        background += [off for _, _, _, off in measured]
        h = a.sync_every
        starts = [marks[r * h][0] for r in range(a.rounds)] + [marks[-1][0]]
        walls = [starts[r + 1] - starts[r] for r in range(warmup(a, overlap), a.rounds - 1)]  # not the last either
        utils.append(h * a.step_seconds * len(walls) / sum(walls))
        lost.append(where_lost(marks, a, len(walls), overlap))
    return {"utilisation": statistics.mean(utils), "per_island": utils, "lost_per_round": lost,
            "exchange_per_island": per_exchange,
            "run_host_seconds": statistics.mean(host) if host else 0.0,
            "run_exchange_seconds": statistics.mean(exchange) if exchange else 0.0,
            "run_sync_seconds": statistics.mean(blocked) if blocked else 0.0,
            "run_background_seconds": statistics.mean(background) if background else 0.0,
            "coordinator": coordinator_split(history, a, overlap)}  # fmt: skip


def start_relay(link, k: int, ports: list[str], tmp: Path, ca: str) -> tuple[subprocess.Popen, str]:
    """Relay ``k`` (``atoll relay``) in ``link``'s site, its upstream the coordinator across the link:
    the process and the address its islands reach it at (the site's loopback)."""
    port_file = tmp / f"relay-{k}.port"
    flags = [
        "relay", "--upstream", f"{link.coordinator_host}:{ports[0]}", "--run-id", "u", "--relay-id", f"relay-{k}",
        "--host", "127.0.0.1", "--port", "0", "--port-file", str(port_file), "--log-level", "WARNING",
        *(["--upstream-ca", ca] if ca else []),
    ]  # fmt: skip
    proc = subprocess.Popen(link.site_command([sys.executable, "-m", "atoll", *flags]), cwd=ROOT)
    while not port_file.exists():
        if proc.poll() is not None:
            raise RuntimeError(f"relay {k} exited")
        time.sleep(0.1)
    return proc, f"127.0.0.1:{port_file.read_text().strip()}"  # (one port: write_port_file's)


def coordinator_split(history: list[dict], a, overlap: int) -> dict:
    """The coordinator's own seconds per round (the fragments' summed), the median over the measured
    rounds: decoding the pushes into the sum, the outer step (the downlink's encoding in it), the
    record's write before the update is served, and the rest of the publish (these two from fragment
    0's admin server, counted for every fragment)."""
    per_round: dict[int, dict] = {}
    for h in history:
        got = per_round.setdefault(h["round"], {})
        for k in ("decode_seconds", "outer_step_seconds", "persist_seconds", "publish_seconds"):
            got[k] = got.get(k, 0.0) + h.get(k, 0.0)
    measured = [v for r, v in per_round.items() if warmup(a, overlap) <= r < a.rounds - 1]
    keys = measured[0] if measured else {}
    return {k.removesuffix("_seconds"): round(statistics.median(m[k] for m in measured), 3) for k in keys}


def where_lost(marks: list, a, rounds: int, overlap: int) -> dict:
    """Seconds a measured round spends beyond its replayed steps, by the step's place in the round:
    the step that launches the exchange (H-1), the one that merges it (τ-1, in the next round), the
    one that waits at a round's first step (0), and all the others together."""
    h, excess = a.sync_every, {}
    for i in range(warmup(a, overlap) * h, (warmup(a, overlap) + rounds) * h):
        at = i % h
        extra = marks[i + 1][0] - marks[i][0] - a.step_seconds
        excess[at] = excess.get(at, 0.0) + extra / rounds
    named = {"launch": h - 1, "merge": (overlap - 1) % h if overlap else None, "first": 0}
    out = {k: round(excess.get(v, 0.0), 3) for k, v in named.items() if v is not None}
    out["others"] = round(sum(v for k, v in excess.items() if k not in named.values()), 3)
    out["worst"] = [(k, round(v, 3)) for k, v in sorted(excess.items(), key=lambda kv: -kv[1])[:4]]
    return out


def island_flags(a) -> list[str]:
    return ["--step-seconds", str(a.step_seconds), "--sync-every", str(a.sync_every), "--rounds", str(a.rounds),
            "--fragments", str(a.fragments), *([] if a.dense else ["--sparse-updates"])]  # fmt: skip


def host_work(codec: str, repeat: int = 3) -> float:
    """Seconds of an island's own passes over θ per round, one thread: Δ = θ_start − θ, its encoding,
    the update's decoding (int8, or identity) and its apply with the progress kept (overlap's merge)."""
    import torch

    from atoll.compression import ErrorFeedback, get_codec
    from atoll.models import TinyGPT, preset

    torch.set_num_threads(1)
    params = [p.detach() for p in TinyGPT(preset("gpt-125m", vocab_size=50257)).parameters()]
    start = [p.clone() for p in params]
    up, down = get_codec(codec), get_codec(downlink_for(codec))
    if up.drops_values:
        up = ErrorFeedback(up)
    updates = [down.encode((p * 1e-3).contiguous()) for p in params]
    times, states = [], {}
    for _ in range(repeat):
        began = time.perf_counter()
        for p, s, u in zip(params, start, updates, strict=True):
            up.encode((s - p).contiguous(), states.setdefault(id(p), {}))
            new = down.decode(u, p.shape)
            p.add_(new).sub_(s)  # θ_new + (θ − θ_start)
        times.append(time.perf_counter() - began)
    return statistics.median(times)


def predicted(a, overlap: int, host_seconds: float = 0.0, background: float = 0.0) -> tuple[float, float, float]:
    """The planner's utilisation, sync (an exchange) and stall (what the islands wait) for the run's settings."""
    import torch

    from atoll.models import TinyGPT, preset
    from atoll.plan import Candidate, estimate
    from atoll.plan import Link as PlanLink
    from atoll.plan_cli import VOCAB

    with torch.device("meta"):
        shapes = [tuple(p.shape) for p in TinyGPT(preset("gpt-125m", vocab_size=VOCAB["gpt-125m"])).parameters()]
    rate, rtt = (float(x) for x in a.link.split(":"))
    e = estimate(
        Candidate(codec=a.codec, sync_every=a.sync_every, overlap_steps=overlap, fragments=a.fragments),
        shapes=shapes, step_seconds=a.step_seconds, islands=a.islands,
        link=PlanLink(rate_mbit=rate, rtt_ms=rtt, mtu=9000, tls=getattr(a, "tls", False)), host_seconds=host_seconds,
        background_seconds=background, relays=getattr(a, "relays", 0),
        site=PlanLink(rate_mbit=SITE_MBIT, rtt_ms=SITE_RTT_MS, tls=False),
    )  # fmt: skip
    return e.utilisation, e.sync_seconds, e.stall_seconds


SITE_MBIT, SITE_RTT_MS = 10_000.0, 0.5
"""The islands' link to their relay in the planner (``atoll plan``'s defaults): here the loopback of
the relay's namespace, which the planner prices as such a link."""


def replan(log: Path) -> None:
    """The planner as it is now against runs this script printed (their JSON lines in ``log``), with
    the islands' own ``host_seconds``: the runs do not depend on the planner."""
    for line in log.read_text().splitlines():
        if not line.startswith("{"):
            continue
        r = json.loads(line)
        keys = ("link", "islands", "step_seconds", "sync_every", "codec", "fragments")
        a = argparse.Namespace(**{k: r[k] for k in keys}, tls=r.get("tls", False), relays=r.get("relays", 0))
        own = r["run_host_seconds"], r.get("run_background_seconds", 0.0)
        util, sync, stall = predicted(a, r["overlap_steps"], *own)
        print(
            f"{r['link']} x{r['islands']} H={r['sync_every']} {r['codec']} τ={r['overlap_steps']} "
            f"P={r['fragments']}: measured {r['utilisation']:.1%}, planned {util:.1%} "
            f"({100 * (util - r['utilisation']):+.1f}); exchange {r['run_exchange_seconds']:.2f} / {sync:.2f} s, "
            f"the islands' sync {r['run_sync_seconds']:.2f} / {stall:.2f} s"
        )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--link", default="100:100", help="RATE_MBIT:RTT_MS of each island's link")
    p.add_argument("--islands", type=int, default=2)
    p.add_argument(
        "--relays",
        type=int,
        default=0,
        help="the islands sit behind this many relays (atoll relay), island i behind relay i mod R: each relay "
        "has the --link to the coordinator, its islands its namespace's loopback (0: each island its own link)",
    )
    p.add_argument("--step-seconds", type=float, default=0.1)
    p.add_argument("--sync-every", type=int, default=100)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--warmup", type=int, help="rounds left out at the start (default: 1; 2 with overlap)")
    p.add_argument("--codec", default="int8")
    p.add_argument("--overlap", type=int, nargs="+", default=[0, 30], help="overlap steps τ to run, each")
    p.add_argument("--overlap-steps", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--fragments", type=int, default=1)
    p.add_argument("--tls", action="store_true", help="the coordinator serves TLS (a self-signed certificate)")
    p.add_argument("--tls-ca", default="", help=argparse.SUPPRESS)
    p.add_argument(
        "--sparse-updates",
        dest="dense",
        action="store_false",
        help="each step nudges one value only (before 2026-12-07: the sums the coordinator encodes are then almost "
        "all zeros, and a top-k of those takes 0.66 s at 124M where a dense one takes 1.59 s); by default every "
        "parameter also moves once a round, inside the replayed step's time",
    )
    p.add_argument("--dump", type=Path, help="write each island's raw output here (steps, rounds, slow steps)")
    p.add_argument("--island", nargs=2, metavar=("ADDRESSES", "NAME"), help=argparse.SUPPRESS)
    p.add_argument(
        "--replan", type=Path, metavar="LOG", help="print today's planner against the JSON lines of earlier runs"
    )
    a = p.parse_args()
    if a.replan:
        replan(a.replan)
        return
    if a.island:
        island(a.island[0], a.island[1], a)
        return
    if a.relays and (a.fragments > 1 or a.relays > a.islands):
        p.error("--relays needs --fragments 1 and at most --islands relays")
    enter_namespace([str(Path(__file__).resolve()), *sys.argv[1:]])
    print(
        f"gpt-125m, {a.islands} islands "
        + (f"behind {a.relays} relays, each relay" if a.relays else "each")
        + f" on its own {a.link} link (Mbit/s:ms), a replayed step of "
        f"{a.step_seconds:g} s, H={a.sync_every}, {a.codec}, {a.fragments} fragment(s), {a.rounds} rounds "
        f"(measured: from round {a.warmup if a.warmup is not None else '1 (2 with overlap)'} to {a.rounds - 2})"
        f"{', TLS' if a.tls else ''}",
        flush=True,
    )
    host = host_work(a.codec)
    print(f"  an island's host work per round, timed on one thread: {host:.2f} s", flush=True)
    for tau in a.overlap:
        got = measure(a, tau)
        util, sync, _ = predicted(a, tau)
        util_host, _, _ = predicted(a, tau, host)
        run_host, run_exchange, run_sync = got["run_host_seconds"], got["run_exchange_seconds"], got["run_sync_seconds"]
        util_run_host, _, stall = predicted(a, tau, run_host, got["run_background_seconds"])
        print(
            f"  overlap τ={tau}: utilisation {got['utilisation']:.1%} (islands "
            f"{', '.join(f'{u:.1%}' for u in got['per_island'])}; their exchanges "
            f"{', '.join(f'{x:.2f}' for x in got['exchange_per_island'])} s); atoll plan predicts {util:.1%} "
            f"(an exchange {sync:.2f} s), {util_host:.1%} with --host-seconds {host:.2f}, {util_run_host:.1%} "
            f"with the islands' own host_seconds {run_host:.2f} (and {got['run_background_seconds']:.2f} s of their "
            f"own work on the exchange's thread); a round's exchanges took {run_exchange:.2f} s "
            f"on the link and coordinator (predicted {sync:.2f}; the coordinator's own part: {got['coordinator']}),"
            f" the islands' sync {run_sync:.2f} s (predicted stall with their own host_seconds {stall:.2f}); "
            f"seconds lost a round, by step: {got['lost_per_round']}",
            flush=True,
        )
        keys = ("link", "islands", "relays", "step_seconds", "sync_every", "codec", "fragments", "tls", "dense")
        settings = {k: getattr(a, k) for k in keys}
        print(
            json.dumps(
                {**settings, "overlap_steps": tau, **got, "predicted": util, "sync": sync,
                 "host_seconds": host, "predicted_with_host": util_host,
                 "predicted_with_run_host": util_run_host, "predicted_stall_with_run_host": stall}
            ),
            flush=True,
        )  # fmt: skip


if __name__ == "__main__":
    main()
