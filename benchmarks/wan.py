"""Compute utilisation of islands over an emulated WAN, beside the same run on loopback.

    python benchmarks/wan.py [--rounds 6] [--sync-every 30] [--rtt-ms 100] [--rate-mbit 100] [--overlap-steps 15]

Two islands (separate processes) train the reference model; in the WAN runs each island reaches the
coordinator through its own user-space asyncio proxy (see atoll.harness.wan) adding the RTT and
bandwidth limit. Utilisation = 1 - (time the training loop spent on the outer exchange) / (round
time), per round, from the islands' own timings (evaluation excluded). Three runs in this one
invocation: loopback, WAN, and WAN with the exchange overlapped with --overlap-steps inner steps.
Round 0 (warm-up, islands joining) and the last round (with overlap it is drained at the end of
training, with nothing left to overlap) are left out of every run alike.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

import common  # noqa: F401  (the repository and benchmarks/ on the path: benchmarks/common.py)

from atoll.harness import ProcessGroup
from atoll.harness.wan import EMULATION, LinkProfile, ProxyThread


def run(work: Path, args, profile: LinkProfile | None, overlap: int = 0) -> dict:
    with ProcessGroup(work) as group:
        coord, address = group.start_coordinator(
            work / "state",
            [
                "--run-id",
                "wan",
                "--sync-every",
                str(args.sync_every),
                "--quorum",
                "2",
                "--round-deadline-seconds",
                "600",
                *("--codec", "identity", "--downlink-codec", "identity"),
                *("--bulk-port", "-1"),  # the emulated links proxy the gRPC port; a bulk port would bypass them
            ],
        )
        proxies = [ProxyThread(address, profile).start() for _ in range(2)] if profile else []
        try:
            islands = [
                group.start(
                    f"island-{i}",
                    [
                        "island",
                        "--coordinator",
                        proxies[i].address if proxies else address,
                        "--island-id",
                        f"i{i}",
                        "--run-id",
                        "wan",
                        "--rounds",
                        str(args.rounds),
                        "--no-eval-every-round",
                        "--no-digest",
                        "--overlap-steps",
                        str(overlap),
                    ],
                )
                for i in range(2)
            ]
            events = []
            for p in islands:
                while (ev := p.next_event(timeout=600)) is not None:
                    events.append(ev)
                    if ev["event"] == "done":
                        break
                if p.wait(60) != 0:
                    raise RuntimeError(f"{p.name} failed:\n{p.log_tail()}")
        finally:
            for px in proxies:
                px.stop()
        coord.stop()
    rounds = [e for e in events if e["event"] == "round" and 0 < e["round"] < args.rounds - 1]
    util = [1 - e["sync_seconds"] / e["round_seconds"] for e in rounds]
    return {
        "utilisation": statistics.mean(util),
        "sync_s": statistics.mean(e["sync_seconds"] for e in rounds),
        "round_s": statistics.mean(e["round_seconds"] for e in rounds),
        "bytes_per_round": statistics.mean(e["bytes_sent"] + e["bytes_received"] for e in rounds),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--sync-every", type=int, default=30)
    ap.add_argument("--rtt-ms", type=float, default=100.0)
    ap.add_argument("--rate-mbit", type=float, default=100.0)
    ap.add_argument("--overlap-steps", type=int, default=15)
    args = ap.parse_args()
    if args.rounds < 3:
        ap.error("--rounds must be >= 3 (the first and last rounds are not measured)")
    profile = LinkProfile(rtt_ms=args.rtt_ms, rate_mbit=args.rate_mbit)
    with tempfile.TemporaryDirectory() as tmp:
        loop = run(Path(tmp) / "loopback", args, None)
        wan = run(Path(tmp) / "wan", args, profile)
        over = run(Path(tmp) / "wan-overlap", args, profile, overlap=args.overlap_steps)
    print(
        f"2 islands, H={args.sync_every}, {args.rounds} rounds; WAN emulation: {EMULATION}, "
        f"{args.rate_mbit:g} Mbit/s, {args.rtt_ms:g} ms RTT"
    )
    print(f"{'link':16s} {'compute util':>12s} {'sync s/round':>12s} {'round s':>8s} {'bytes/round/island':>18s}")
    for name, r in [("loopback", loop), ("wan", wan), (f"wan+overlap {args.overlap_steps}", over)]:
        print(
            f"{name:16s} {r['utilisation']:12.1%} {r['sync_s']:12.3f} {r['round_s']:8.3f} {r['bytes_per_round']:18,.0f}"
        )
    print(f"utilisation wan / loopback: {wan['utilisation'] / loop['utilisation']:.3f}")
    print(f"utilisation wan+overlap / loopback: {over['utilisation'] / loop['utilisation']:.3f}")


if __name__ == "__main__":
    main()
