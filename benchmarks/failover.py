"""A coordinator killed again and again while a hot standby follows it: how long until the run moves on.

    python benchmarks/failover.py [--model tiny] [--kills 20] [--lease 2]

A SeaweedFS server on loopback (atoll.harness.seaweed), a primary ``atoll coordinator --state-dir
s3://bench/run`` and a standby (``--standby``, its own port and working dir), two ``atoll island``
processes (the model preset on generated tokens, 1 x 64-token batches, int8 both ways) given both
addresses (``a|b``). Each kill: once the standby follows and the primary has closed a round of its
own, a random moment into a round (uniform over ``--round-spread`` s) the primary is SIGKILLed; the
standby takes the lease when it lapses and serves. Timed from the kill: the standby serving (its admin
port answering) and the round open at the kill closed (published) by it. A fresh standby then starts
where the killed one was (the killed one's port, a new working dir), and the next kill is of the new
primary. No supervisor loop: nothing restarts a coordinator that exits. The coordinators run with
``--exact-failover`` (``--no-exact-failover``: without it). Before each kill the primary's
``/api/status`` says how its lease renewals went (each PUT's time, the longest the lease went
unrenewed), printed beside the lease's length.

Then the same run again without kills (``--no-compare`` skips it) for as many rounds: θ after every
round, as island i0 reports it (``digest``, sha256 of θ), must be bitwise the uninterrupted run's.
Printed: the percentiles over kills, the rounds lost (a round number an island never saw closed), and
the first round whose θ differs, if any, with what the standby said of it.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import shutil
import signal
import statistics
import tempfile
import time
import urllib.request
from pathlib import Path

import common  # noqa: F401  (the repository and benchmarks/ on the path: benchmarks/common.py)

from atoll.harness import ProcessGroup
from atoll.harness.seaweed import SeaweedS3, free_ports
from benchmarks.gpu import make_tokens

TOOK_OVER = re.compile(r"standby: took over run \S+ in \S+ at round (\d+) \(([^;]+); (\d+) rounds followed")


def status(admin: str) -> dict | None:
    """The coordinator's ``/api/status`` (None: it does not answer, not serving yet or killed)."""
    try:
        with urllib.request.urlopen(f"http://{admin}/api/status", timeout=2) as resp:
            return json.load(resp)
    except OSError:
        return None


def published(admin: str) -> int:
    got = status(admin)
    return int(got["round"]) if got is not None else -1


def percentile(xs: list[float], q: float) -> float:
    """The nearest-rank percentile (p99 of 20 values is the largest)."""
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, -(-len(s) * q // 100) - 1))] if s else float("nan")


class Run:
    """One run: the store, two coordinator slots and two islands."""

    def __init__(self, args, tmp: Path, store: SeaweedS3, name: str, data: Path) -> None:
        self.args, self.tmp, self.env, self.name, self.data = args, tmp / name, store.env(), name, data
        self.url = f"s3://bench/{name}"
        self.ports = free_ports(6)
        self.flags = [
            *("--run-id", "fo", "--sync-every", str(args.sync_every), "--quorum", "2", "--codec", "int8"),
            *("--downlink-codec", "int8", "--store-lease-seconds", str(args.lease), "--threads", "1"),
            *("--round-deadline-seconds", "300"),
            *(["--exact-failover"] if args.exact_failover else []),
        ]
        self.starts = 0
        self.digests: dict[int, str] = {}
        self.rounds_seen: dict[str, set[int]] = {"i0": set(), "i1": set()}
        self.round_seconds: list[float] = []

    def slot(self, k: int) -> tuple[int, int, int]:
        return self.ports[3 * k], self.ports[3 * k + 1], self.ports[3 * k + 2]

    def admin(self, k: int) -> str:
        return f"127.0.0.1:{self.slot(k)[2]}"

    def coordinator(self, group: ProcessGroup, k: int, *, standby: bool):
        port, bulk, admin = self.slot(k)
        self.starts += 1
        flags = [*self.flags, "--bulk-port", str(bulk), "--admin-port", str(admin)]
        flags += ["--work-dir", str(self.tmp / f"w{self.starts}")]
        if not standby:
            proc, _ = group.start_coordinator(
                self.url, flags, name=f"{self.name}-c{self.starts}", port=port, env=self.env, timeout=300
            )
            return proc
        return group.start_standby(self.url, flags, port=port, name=f"{self.name}-c{self.starts}", env=self.env)

    def islands(self, group: ProcessGroup, rounds: int):
        both = f"127.0.0.1:{self.slot(0)[0]}|127.0.0.1:{self.slot(1)[0]}"
        return [
            group.start(
                f"{self.name}-i{k}",
                [
                    *("island", "--coordinator", both, "--island-id", f"i{k}", "--run-id", "fo"),
                    *("--data", str(self.data), "--model", self.args.model, "--batch-size", "1"),
                    *("--block-size", "64", "--codec", "int8", "--no-eval-every-round", "--threads", "1"),
                    *("--give-up-seconds", "900", "--rounds", str(rounds)),
                ],
            )
            for k in range(2)
        ]

    def drain(self, islands) -> None:
        for p in islands:
            while (ev := p.next_event(timeout=0)) is not None:
                if ev.get("event") == "round":
                    self.rounds_seen[ev["island"]].add(ev["round"])
                    if ev["island"] == "i0" and ev.get("digest"):
                        self.digests[ev["round"]] = ev["digest"]
                    if ev["island"] == "i0" and ev.get("round_seconds"):
                        self.round_seconds.append(ev["round_seconds"])


def wait(cond, what: str, deadline: float, procs=(), tick: float = 0.02) -> None:
    """Until ``cond()``; RuntimeError with the logs of ``procs`` (the processes that must stay up
    meanwhile) when one of them exits, or at ``deadline``."""
    while not cond():
        gone = [p.name for p in procs if p.poll() is not None]
        if gone or time.monotonic() > deadline:
            why = f"{', '.join(gone)} exited" if gone else "timed out"
            raise RuntimeError(f"{why} waiting for {what}:\n" + "\n".join(p.log_tail() for p in procs))
        time.sleep(tick)


def with_kills(args, run: Run, group: ProcessGroup) -> list[dict]:
    deadline = time.monotonic() + args.timeout
    primary = run.coordinator(group, 0, standby=False)
    standby, active = run.coordinator(group, 1, standby=True), 0
    islands = run.islands(group, 100_000)
    kills = []
    rng = random.Random(args.seed)
    for n in range(args.kills):
        kills.append(kill_once(args, run, primary, standby, active, islands, rng, deadline))
        k = kills[-1]
        print(
            f"kill {n + 1}: round {k['round']} open; the standby served after {k['serving']:.2f} s and closed it "
            f"after {k['closed']:.2f} s ({k['how']}, {k['followed']} rounds followed"
            + (", optimizer state of an older round)" if k["behind"] else ")"),
            flush=True,
        )
        primary, active = standby, 1 - active
        standby = run.coordinator(group, 1 - active, standby=True)
        run.drain(islands)
    procs = [primary, standby, *islands]
    wait(lambda: published(run.admin(active)) > kills[-1]["round"] + 2, "two more rounds", deadline, procs)
    for p in islands:
        p.stop()
    run.drain(islands)
    primary.stop()
    standby.stop()
    return kills


def kill_once(args, run: Run, primary, standby, active: int, islands, rng, deadline: float) -> dict:
    """SIGKILL the primary (slot ``active``) a random moment into a round once the standby follows;
    the times until the standby serves and until it closes the round that was open."""
    procs, other = [primary, standby, *islands], 1 - active
    wait(lambda: "following run fo" in standby.log_tail(100_000), "the standby to follow", deadline, procs)
    start_round = published(run.admin(active))
    wait(lambda: published(run.admin(active)) > start_round, "a round of the primary", deadline, procs, 0.005)
    time.sleep(rng.uniform(0, args.round_spread))
    run.drain(islands)
    lease = (status(run.admin(active)) or {}).get("lease")  # how its renewals went, up to the kill
    primary.signal(signal.SIGKILL)
    killed = time.monotonic()
    primary.wait(10)
    procs = [standby, *islands]
    wait(lambda: published(run.admin(other)) >= 0, "the standby to serve", deadline, procs, 0.005)
    serving = time.monotonic() - killed
    wait(lambda: TOOK_OVER.search(standby.log_tail(100_000)), "the takeover line", deadline, procs)
    took = TOOK_OVER.search(standby.log_tail(100_000))
    open_round = int(took.group(1))
    wait(lambda: published(run.admin(other)) > open_round, "the open round closed", deadline, procs, 0.005)
    closed = time.monotonic() - killed
    behind = "outer optimizer state of round" in standby.log_tail(100_000)
    return {
        "serving": serving,
        "closed": closed,
        "round": open_round,
        "behind": behind,
        "how": took.group(2),
        "followed": int(took.group(3)),
        "lease": lease,
    }


def uninterrupted(args, run: Run, group: ProcessGroup, rounds: int) -> None:
    primary = run.coordinator(group, 0, standby=False)
    islands = run.islands(group, rounds)
    deadline = time.monotonic() + args.timeout
    wait(lambda: all(p.poll() is not None for p in islands), f"{rounds} rounds", deadline, [primary], 0.2)
    run.drain(islands)
    primary.stop()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    p.add_argument("--model", default="tiny")
    p.add_argument("--kills", type=int, default=20)
    p.add_argument("--lease", type=float, default=2.0, help="--store-lease-seconds (default: 2)")
    p.add_argument("--sync-every", type=int, default=10)
    p.add_argument("--round-spread", type=float, default=0.5, help="kill within this many s of a round (default 0.5)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-compare", action="store_true", help="skip the uninterrupted run")
    p.add_argument(
        "--exact-failover",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="the coordinators' --exact-failover (default: on)",
    )
    p.add_argument("--timeout", type=float, default=1800.0)
    p.add_argument("--work-dir", type=Path, default=None, help="keep the processes' logs there")
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="atoll-failover-") as tmp:
        tmp = Path(tmp)
        if args.work_dir is not None:
            shutil.rmtree(args.work_dir, ignore_errors=True)
            tmp = args.work_dir
        store = SeaweedS3(tmp / "seaweed").start()
        try:
            store.make_bucket("bench")
            data = tmp / "train.bin"
            make_tokens(data, 400_000, 256 if args.model == "tiny" else 50257)
            killed = Run(args, tmp, store, "kills", data)
            with ProcessGroup(tmp / "procs") as group:
                kills = with_kills(args, killed, group)
            closed, serving = [k["closed"] for k in kills], [k["serving"] for k in kills]
            last = min(max(s) for s in killed.rounds_seen.values())
            lost = [r for r in range(last + 1) if any(r not in s for s in killed.rounds_seen.values())]
            print(
                f"model {args.model}, lease {args.lease:g} s, {len(kills)} kills, rounds 0..{last}: the open round "
                f"closed after p50 {percentile(closed, 50):.2f} s, p90 {percentile(closed, 90):.2f} s, "
                f"p99 {percentile(closed, 99):.2f} s, max {max(closed):.2f} s (mean {statistics.mean(closed):.2f}); "
                f"the standby served after p50 {percentile(serving, 50):.2f} s, p99 {percentile(serving, 99):.2f} s; "
                f"rounds lost {len(lost)} {lost[:5]}; the optimizer state of an older round at "
                f"{sum(k['behind'] for k in kills)} takeovers; a round took "
                f"{statistics.median(killed.round_seconds):.2f} s (median, island i0's, compute and sync)"
            )
            leases = [k["lease"] for k in kills if k.get("lease")]
            if leases:
                put_mean = statistics.mean(x["put_seconds_mean"] for x in leases) * 1e3
                put_max = max(x["put_seconds_max"] for x in leases) * 1e3
                unrenewed = max(x["unrenewed_seconds_max"] for x in leases)
                print(
                    f"the primaries' lease renewals ({sum(x['renewals'] for x in leases)} in all, every "
                    f"{args.lease / 3:.2f} s): PUT mean {put_mean:.1f} ms, max {put_max:.1f} ms; the longest the "
                    f"lease went unrenewed {unrenewed:.3f} s of its {args.lease:g} s"
                )
            if args.no_compare:
                return
            ref = Run(args, tmp, store, "ref", data)
            with ProcessGroup(tmp / "procs-ref") as group:
                uninterrupted(args, ref, group, last + 1)
            both = sorted(set(killed.digests) & set(ref.digests))
            differ = [r for r in both if killed.digests[r] != ref.digests[r]]
            kill_rounds = [k["round"] for k in kills]
            print(
                f"θ after every round against the uninterrupted run: {len(both) - len(differ)} of {len(both)} rounds "
                "bitwise equal"
                + (f"; the first that differs: round {differ[0]} (kills at rounds {kill_rounds})" if differ else "")
            )
        finally:
            from atoll.objects import close_client

            close_client()
            store.stop()


if __name__ == "__main__":
    main()
