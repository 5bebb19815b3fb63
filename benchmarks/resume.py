"""An island SIGKILLed mid-round and restarted from its checkpoint: the same θ as an uninterrupted run.

    python benchmarks/resume.py [--rounds 5] [--sync-every 30] [--kill-after-round 1]

Two islands (``atoll island --checkpoint-dir``) and a coordinator (quorum 2, ``--total-rounds``) as
processes. The reference run goes uninterrupted; in the second, island i1 is SIGKILLed a few steps
into the round after ``--kill-after-round`` and restarted at once with the same command. Printed:
the final θ of both runs (digests: bitwise equal), the heal time (from the kill to the coordinator
accepting the island's next push), and the checkpoint's cost per round on the training thread, each
beside the round time.
"""

from __future__ import annotations

import argparse
import json
import signal
import statistics
import tempfile
import time
import urllib.request
from pathlib import Path

import common  # noqa: F401  (the repository and benchmarks/ on the path: benchmarks/common.py)

from atoll.coordinator.disk import snapshots
from atoll.harness import ProcessGroup
from atoll.workload.digest import param_digest


def island_cmd(address: str, island: str, ckpt: str, args) -> list[str]:
    return [
        *("island", "--coordinator", address, "--island-id", island, "--run-id", "resume"),
        *("--checkpoint-dir", f"{ckpt}/{island}", "--inner-lr", "3e-3", "--no-eval-every-round", "--no-digest"),
        *getattr(args, "island_flags", "").split(),
    ]


def admin_status(admin_file: Path) -> dict:
    with urllib.request.urlopen(f"http://127.0.0.1:{admin_file.read_text().strip()}/api/status", timeout=10) as r:
        return json.loads(r.read())


def run(work: Path, args, kill: bool, sig: int = signal.SIGKILL, store=None) -> dict:
    """One run; with ``kill``, island i1 gets ``sig`` a little into the round after
    ``args.kill_after_round`` and is restarted with the same command. ``store``: a SeaweedS3 the
    islands checkpoint to (``s3://bench/<run>``) instead of a local dir."""
    admin_file = work / "admin.port"
    ckpt, env = (f"s3://bench/{work.name}", store.env()) if store is not None else (str(work / "ckpt"), None)
    out: dict = {"round_seconds": [], "checkpoint_seconds": []}
    with ProcessGroup(work) as group:
        coord, address = group.start_coordinator(
            work / "state",
            [
                *("--run-id", "resume", "--sync-every", str(args.sync_every), "--quorum", "2"),
                *("--codec", "identity", "--downlink-codec", "identity"),
                *("--total-rounds", str(args.rounds), "--round-deadline-seconds", "600"),
                *("--admin-port", "0", "--admin-port-file", str(admin_file)),
            ],
        )
        islands = {i: group.start(i, island_cmd(address, i, ckpt, args), env) for i in ("i0", "i1")}
        done, killed_at = set(), None
        deadline = time.monotonic() + 600
        while len(done) < 2:
            if time.monotonic() > deadline:
                raise TimeoutError("the run did not finish: " + islands["i1"].log_tail())
            for name, proc in list(islands.items()):
                ev = proc.next_event(0.02)
                if ev is None:
                    continue
                if ev["event"] == "round":
                    out["round_seconds"].append(ev["round_seconds"])
                    out["checkpoint_seconds"].append(ev["checkpoint_seconds"])
                if ev["event"] == "done":
                    done.add(name)
                if (
                    kill
                    and killed_at is None
                    and name == "i1"
                    and ev["event"] == "round"
                    and ev["round"] == args.kill_after_round
                ):
                    time.sleep(args.kill_delay)  # a few inner steps into the next round
                    before = {i["island"]: i for i in admin_status(admin_file)["islands"]}["i1"]["rounds_committed"]
                    proc.signal(sig)
                    killed_at = time.monotonic()
                    out["killed_exit"] = proc.wait(60)
                    out["exit_seconds"] = time.monotonic() - killed_at
                    islands["i1"] = group.start("i1-restarted", island_cmd(address, "i1", ckpt, args), env)
                    restarted = time.monotonic()
                    while True:  # the coordinator accepts i1's next push
                        now = {i["island"]: i for i in admin_status(admin_file)["islands"]}["i1"]
                        if now.get("rounds_committed", 0) > before:
                            out["heal_seconds"] = time.monotonic() - killed_at
                            out["rejoin_seconds"] = time.monotonic() - restarted
                            break
                        if time.monotonic() - killed_at > 300:
                            raise TimeoutError("the restarted island never pushed")
                        time.sleep(0.05)
        codes = [p.wait(60) for p in islands.values()]
        coord.stop()
        if codes != [0, 0]:
            raise RuntimeError(f"islands exited {codes}")
    snap = snapshots.load(work / "state")
    out.update(digest=param_digest(snap.params), round=snap.round, history=snap.history)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    p.add_argument("--rounds", type=int, default=5, help="total rounds of the run (default: 5)")
    p.add_argument("--sync-every", type=int, default=30, help="H (default: 30)")
    p.add_argument("--kill-after-round", type=int, default=1, help="kill i1 in the round after this one (default: 1)")
    p.add_argument("--kill-delay", type=float, default=0.3, help="seconds into that round (default: 0.3)")
    p.add_argument("--signal", choices=["KILL", "TERM"], default="KILL", help="what i1 gets (default: KILL)")
    p.add_argument("--island-flags", default="", help='more `atoll island` flags ("--inner-optimizer muon")')
    p.add_argument(
        "--checkpoint-store", action="store_true", help="checkpoint to s3:// (a SeaweedFS server on loopback)"
    )
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="atoll-resume-") as tmp:
        store = None
        if args.checkpoint_store:
            from atoll.harness.seaweed import SeaweedS3

            store = SeaweedS3(Path(tmp) / "seaweed").start()
            store.make_bucket("bench")
        try:
            ref = run(Path(tmp) / "ref", args, kill=False, store=store)
            got = run(Path(tmp) / "killed", args, kill=True, sig=getattr(signal, f"SIG{args.signal}"), store=store)
        finally:
            if store is not None:
                store.stop()
    print(
        f"{args.rounds} rounds of H={args.sync_every}, 2 islands with --checkpoint-dir "
        f"{'s3://' if args.checkpoint_store else '(local)'}, i1 SIG{args.signal} in round "
        f"{args.kill_after_round + 1} and restarted with the same command"
    )
    print(f"i1 exited {got['killed_exit']} {got['exit_seconds']:.2f}s after the signal")
    print(f"final θ, uninterrupted: {ref['digest'][:16]} (round {ref['round']})")
    print(
        f"final θ, killed + resumed: {got['digest'][:16]} (round {got['round']})  "
        f"{'bitwise equal' if got['digest'] == ref['digest'] else 'DIFFERENT'}"
    )
    losses = [(h["loss"], g["loss"]) for h, g in zip(ref["history"], got["history"], strict=True)]
    print("round losses equal: " + ("yes" if all(a == b for a, b in losses) else f"NO {losses}"))
    round_s = statistics.median(ref["round_seconds"])
    print(f"round time (median, islands' own): {round_s:.2f}s")
    print(
        f"heal time (kill -> next push accepted): {got['heal_seconds']:.2f}s"
        f" = {got['heal_seconds'] / round_s:.1f} rounds; from its restart: {got['rejoin_seconds']:.2f}s"
        f" = one round + {got['rejoin_seconds'] - round_s:.2f}s"
    )
    ck = statistics.median(got["checkpoint_seconds"])
    print(
        f"checkpoint cost per round on the training thread (median): {ck * 1000:.1f} ms"
        f" = {100 * ck / round_s:.2f}% of a round"
    )


if __name__ == "__main__":
    main()
