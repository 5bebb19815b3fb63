"""Lightweight islands through relays, against the same islands in a flat star: the root's ingress, a
round's close time, θ fanned out, and what each island costs here.

    python benchmarks/relays.py [--islands 256] [--relays 16] [--numel 1048576] [--rounds 3]

Each island is a thread with its own client speaking the real protocol to a real process (join, the
int8 push of a pre-encoded payload, a long-poll pull); the root and each relay are `atoll coordinator`
and `atoll relay` processes on loopback. Both layouts run in this one invocation, the relayed first.
Reported per layout: the root's ingress per round (its own record's bytes_in, counted as the pushes
arrived), a round's close time (from the release of the islands' pushes to the last island's update
in hand) beside one island's push alone, the seconds θ took to reach every island (the first pulls),
and the bench process's RSS and CPU per island.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
import urllib.request
from pathlib import Path

import common  # noqa: F401  (the repository and benchmarks/ on the path)
import torch
from load import cpu_seconds, released_together, rss_kib

from atoll.compression import get_codec
from atoll.harness import ProcessGroup
from atoll.islands import CoordinatorClient, RetryPolicy
from atoll.protos import coordinator_pb2 as pb

RUN = "relays"


def port_of(path: Path, proc, timeout: float = 60.0) -> int:
    deadline = time.monotonic() + timeout
    while not (path.exists() and path.read_text().strip()):
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"{proc.name} reported no port:\n{proc.log_tail()}")
        time.sleep(0.05)
    return int(path.read_text().strip())


def run(islands: int, relays: int, numel: int, rounds: int, work: Path) -> dict:
    work.mkdir(parents=True)
    payload = get_codec("int8").encode(torch.randn(numel) * 1e-3)
    zeros = get_codec("identity").encode(torch.zeros(numel))
    with ProcessGroup(work) as group:  # (the root's quorum counts islands, those behind relays too)
        flags = ["--run-id", RUN, "--sync-every", "1", "--quorum", str(islands), "--round-deadline-seconds", "600"]
        flags += ["--codec", "int8", "--downlink-codec", "int8", "--lease-seconds", "120", "--admin-port", "0"]
        flags += ["--admin-port-file", str(work / "admin.port")]
        root_proc, root = group.start_coordinator(work / "state", flags, name="root")
        admin = port_of(work / "admin.port", root_proc)
        addresses = [root]
        if relays:
            procs = [
                group.start(
                    f"relay-{k}",
                    [
                        "relay",
                        "--upstream",
                        root,
                        "--run-id",
                        RUN,
                        "--relay-id",
                        f"r{k}",
                        "--port-file",
                        str(work / f"r{k}.port"),
                    ],
                )  # fmt: skip
                for k in range(relays)
            ]
            addresses = [f"127.0.0.1:{port_of(work / f'r{k}.port', p)}" for k, p in enumerate(procs)]
        rss_before, cpu_before = rss_kib(os.getpid(), "VmRSS"), cpu_seconds(os.getpid())
        retry = RetryPolicy(give_up_seconds=300, rpc_timeout_seconds=300)
        clients = [CoordinatorClient(addresses[i % len(addresses)], retry=retry) for i in range(islands)]
        for i, c in enumerate(clients):
            req = pb.JoinRequest(run_id=RUN, island_id=f"sim-{i}", codecs=["int8"], num_ranks=1)
            req.tensors.add(name="w", shape=[numel], dtype=pb.DTYPE_FLOAT32)
            if c.join(req).bootstrap:
                h = pb.PushHeader(run_id=RUN, island_id=f"sim-{i}", round=0, kind=pb.PUSH_KIND_INIT, num_ranks=1,
                                  codec="identity")  # fmt: skip
                h.entries.add(name="w", num_bytes=len(zeros))
                c.push(h, [zeros])

        def pull(i: int, have: int) -> None:
            req = pb.PullRequest(run_id=RUN, island_id=f"sim-{i}", have_round=have, wait_seconds=60)
            while True:
                header, _ = clients[i].pull(req)
                if header.kind != pb.UPDATE_KIND_NOT_READY:
                    return

        fan_out, _ = released_together([lambda i=i: pull(i, -1) for i in range(islands)])

        def push(i: int, r: int) -> None:
            h = pb.PushHeader(run_id=RUN, island_id=f"sim-{i}", round=r, kind=pb.PUSH_KIND_DELTA, num_ranks=1,
                              tokens=1000, codec="int8")  # fmt: skip
            h.entries.add(name="w", num_bytes=len(payload))
            out = clients[i].push(h, [payload])
            if out.outcome != pb.PUSH_OUTCOME_COMMITTED:
                raise RuntimeError(f"sim-{i} round {r}: {out}")

        one, close = [], []
        for r in range(rounds):
            t = time.perf_counter()
            push(0, r)  # one island's push, alone
            one.append(time.perf_counter() - t)
            seconds, _ = released_together([lambda i=i, r=r: (push(i, r), pull(i, r)) for i in range(1, islands)])
            pull(0, r)
            close.append(seconds)
        rss_after, cpu_after = rss_kib(os.getpid(), "VmRSS"), cpu_seconds(os.getpid())
        with urllib.request.urlopen(f"http://127.0.0.1:{admin}/api/status", timeout=30) as resp:
            history = json.loads(resp.read())["history"]
        for c in clients:
            c.close()
    return {
        "islands": islands,
        "relays": relays,
        "payload_bytes": len(payload),
        "root_bytes_in": [h["bytes_in"] for h in history],
        "root_members": [len(h["islands"]) for h in history],
        "one_push_seconds": one,
        "close_seconds": close,
        "fan_out_seconds": fan_out,
        "rss_per_island_kib": (rss_after - rss_before) / islands,
        "cpu_per_island_seconds": (cpu_after - cpu_before) / islands,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--islands", type=int, default=256)
    ap.add_argument("--relays", type=int, default=16)
    ap.add_argument("--numel", type=int, default=1 << 20)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        relayed = run(args.islands, args.relays, args.numel, args.rounds, Path(tmp) / "relayed")
        flat = run(args.islands, 0, args.numel, args.rounds, Path(tmp) / "flat")
    fan_in = args.islands / args.relays
    for name, res in (("relayed", relayed), ("flat", flat)):
        close = ", ".join(f"{x:.2f}" for x in res["close_seconds"])
        one = ", ".join(f"{x:.3f}" for x in res["one_push_seconds"])
        ingress = ", ".join(f"{b / 1e6:.1f}" for b in res["root_bytes_in"])
        print(f"{name}: root ingress per round {ingress} MB from {res['root_members']} members")
        print(f"  a round's close {close} s, one island's push alone {one} s")
        print(f"  θ to every island {res['fan_out_seconds']:.2f} s")
        print(f"  per island {res['rss_per_island_kib']:.0f} KiB, {res['cpu_per_island_seconds'] * 1e3:.1f} ms CPU")
    ratio = sum(relayed["root_bytes_in"]) / sum(flat["root_bytes_in"])
    print(f"root ingress relayed / flat: {ratio:.4f} (1/fan-in = {1 / fan_in:.4f}; bound +10%: {1.1 / fan_in:.4f})")
    if args.json:
        args.json.write_text(json.dumps({"relayed": relayed, "flat": flat, "ratio": ratio}, indent=1))


if __name__ == "__main__":
    main()
