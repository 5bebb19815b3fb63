"""The coordinator's memory over a run, in units of fp32 |θ|, and what holds it.

    python benchmarks/coordinator_memory.py [--model gpt-small] [--codec identity] [--rounds 12]

A coordinator (``atoll coordinator``, local state dir, quorum 2, ``--total-rounds``) and two ``atoll
island`` processes (the model preset on generated tokens, 1 x 64-token batches, H=2) as processes.
Sampled every 20 ms: the coordinator's RSS (/proc), and every 0.2 s what it says it holds
(``/api/status`` "memory": θ, the outer optimizer's state, the round's sum, the downlink's error
feedback, the last update's payloads, the pooled push buffers, the reserved push and pull bytes).
Printed: the peak RSS above the RSS before any island joined (VmHWM at the end), against the
in-flight budget, and the holders at their largest, each in |θ|; what they do not cover is the
allocator's and the interpreter's (freed memory not yet returned, transient copies).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import common  # noqa: F401  (the repository and benchmarks/ on the path: benchmarks/common.py)

from atoll.harness import ProcessGroup
from atoll.harness.seaweed import free_ports
from benchmarks.gpu import make_tokens


def kib(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def status(admin: str) -> dict | None:
    try:
        with urllib.request.urlopen(f"http://{admin}/api/status", timeout=5) as resp:
            return json.load(resp)
    except OSError:
        return None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    p.add_argument("--model", default="gpt-small")
    p.add_argument("--codec", default="identity", help="both ways (default: identity)")
    p.add_argument("--rounds", type=int, default=12)
    p.add_argument("--vocab", type=int, default=256, help="of the generated tokens (default: 256)")
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="atoll-memory-") as tmp:
        tmp = Path(tmp)
        data = tmp / "train.bin"
        make_tokens(data, 400_000, args.vocab)
        port, admin_port = free_ports(2)
        admin = f"127.0.0.1:{admin_port}"
        with ProcessGroup(tmp / "procs") as group:
            coord, address = group.start_coordinator(
                tmp / "state",
                [
                    *("--run-id", "mem", "--sync-every", "2", "--quorum", "2", "--codec", args.codec),
                    *("--downlink-codec", args.codec, "--total-rounds", str(args.rounds), "--threads", "1"),
                    *("--admin-port", str(admin_port), "--round-deadline-seconds", "600"),
                ],
                port=port,
            )
            time.sleep(1.0)
            start = kib(coord.pid, "VmRSS") * 1024
            peak, holders, stop = [start], {}, threading.Event()
            budget = [0, 0]

            def sample() -> None:
                last = 0.0
                while not stop.is_set():
                    try:
                        peak[0] = max(peak[0], kib(coord.pid, "VmRSS") * 1024)
                    except (OSError, KeyError):
                        return
                    if time.monotonic() - last > 0.2:
                        last = time.monotonic()
                        got = status(admin)
                        if got and got.get("memory"):
                            for k, v in got["memory"].items():
                                holders[k] = max(holders.get(k, 0), v)
                            total = sum(v for k, v in got["memory"].items())
                            holders["(all at once)"] = max(holders.get("(all at once)", 0), total)
                            budget[:] = [got["inflight_budget_bytes"], got["inflight_peak_bytes"]]
                            holders["num_params"] = got["num_params"]
                    time.sleep(0.02)

            sampler = threading.Thread(target=sample, daemon=True)
            sampler.start()
            islands = [
                group.start(
                    f"i{k}",
                    [
                        *("island", "--coordinator", address, "--island-id", f"i{k}", "--run-id", "mem"),
                        *("--data", str(data), "--model", args.model, "--batch-size", "1", "--block-size", "64"),
                        *("--codec", args.codec, "--no-eval-every-round", "--no-digest", "--threads", "1"),
                    ],
                )
                for k in range(2)
            ]
            deadline = time.monotonic() + 1800
            while any(i.poll() is None for i in islands):
                if time.monotonic() > deadline:
                    raise RuntimeError("the run did not end: " + islands[0].log_tail())
                time.sleep(0.2)
            hwm = kib(coord.pid, "VmHWM") * 1024
            stop.set()
            sampler.join()
            coord.stop()
    theta = 4 * holders["num_params"]
    above = max(hwm, peak[0]) - start
    print(
        f"{args.model} ({holders['num_params'] / 1e6:.1f}M parameters, |θ| = {theta / 1e6:.1f} MB fp32), {args.codec} "
        f"both ways, {args.rounds} rounds, 2 islands: coordinator peak RSS {above / theta:.2f}|θ| above its start "
        f"({start / 1e6:.0f} MB); in-flight budget {budget[0] / theta:.2f}|θ| (its peak use "
        f"{budget[1] / theta:.2f}|θ|): {(above - budget[0]) / theta:.2f}|θ| beside the budget, "
        f"{(above - budget[1]) / theta:.2f}|θ| beside its peak use"
    )
    parts = ", ".join(f"{k} {v / theta:.2f}" for k, v in holders.items() if k != "num_params")
    print(f"held, each at its largest, in |θ|: {parts}")


if __name__ == "__main__":
    main()
