"""A coordinator whose machine is lost, replaced from the object store: how long until the run moves on.

    python benchmarks/failover.py [--model gpt-125m] [--lease 5]

A SeaweedFS server on loopback (atoll.harness.seaweed), a coordinator with ``--state-dir
s3://bench/run`` and two ``atoll island`` processes (the model preset on generated tokens, 1 x 64-token
batches, H=2, int8 both ways) given the coordinator and a standby (``a|b``). After round 2 is published
the coordinator is SIGKILLed and its working dir deleted; a supervisor loop starts the replacement
(another port, another working dir) every second until it is no longer refused for the dead one's
lease. Printed: the time from the kill to the replacement serving, and to the next round it
publishes, with what the replacement's log says it spent pulling and restoring the state.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import signal
import tempfile
import time
import urllib.request
from pathlib import Path

import common  # noqa: F401  (the repository and benchmarks/ on the path: benchmarks/common.py)

from atoll.harness import ProcessGroup
from atoll.harness.seaweed import SeaweedS3, free_ports
from benchmarks.gpu import make_tokens


def published(admin: str) -> int:
    try:
        with urllib.request.urlopen(f"http://{admin}/api/status", timeout=5) as resp:
            return int(json.load(resp)["round"])
    except OSError:
        return -1


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    p.add_argument("--model", default="gpt-125m")
    p.add_argument("--lease", type=float, default=5.0, help="--store-lease-seconds (default: 5)")
    p.add_argument("--timeout", type=float, default=900.0)
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
            env = store.env()
            data = tmp / "train.bin"
            make_tokens(data, 400_000, 50257 if args.model != "tiny" else 256)
            port, bulk, admin, port2, bulk2, admin2 = free_ports(6)
            flags = [
                *("--run-id", "fo", "--sync-every", "2", "--quorum", "2", "--codec", "int8"),
                *("--downlink-codec", "int8", "--store-lease-seconds", str(args.lease), "--threads", "1"),
            ]
            with ProcessGroup(tmp / "procs") as group:
                coord, address = group.start_coordinator(
                    "s3://bench/run",
                    [*flags, "--bulk-port", str(bulk), "--admin-port", str(admin), "--work-dir", str(tmp / "w1")],
                    port=port,
                    env=env,
                    timeout=300,
                )
                both = f"{address}|127.0.0.1:{port2}"
                islands = [
                    group.start(
                        f"i{k}",
                        [
                            *("island", "--coordinator", both, "--island-id", f"i{k}", "--run-id", "fo"),
                            *("--data", str(data), "--model", args.model, "--batch-size", "1", "--block-size", "64"),
                            *("--codec", "int8", "--no-eval-every-round", "--no-digest", "--threads", "1"),
                            *("--give-up-seconds", "900"),
                        ],
                    )
                    for k in range(2)
                ]
                deadline = time.monotonic() + args.timeout
                while published(f"127.0.0.1:{admin}") < 2:
                    if time.monotonic() > deadline or any(i.poll() is not None for i in islands):
                        raise RuntimeError("the run did not reach round 2: " + islands[0].log_tail())
                    time.sleep(0.2)
                coord.signal(signal.SIGKILL)
                killed = time.monotonic()
                coord.wait(10)
                shutil.rmtree(tmp / "w1")
                attempts, replacement = 0, None
                while replacement is None:
                    attempts += 1
                    try:
                        replacement, _ = group.start_coordinator(
                            "s3://bench/run",
                            [*flags, "--bulk-port", str(bulk2), "--admin-port", str(admin2)]
                            + ["--work-dir", str(tmp / "w2")],
                            name=f"replacement-{attempts}",
                            port=port2,
                            env=env,
                            timeout=300,
                        )
                    except RuntimeError as err:
                        if "is held by coordinator" not in str(err) and attempts > 1:
                            raise
                        time.sleep(1.0)
                serving = time.monotonic() - killed
                restored = published(f"127.0.0.1:{admin2}")  # the open round it restored
                while published(f"127.0.0.1:{admin2}") <= restored:  # until it closes one itself
                    if time.monotonic() > deadline:
                        raise RuntimeError("no round after the failover: " + replacement.log_tail())
                    time.sleep(0.1)
                moved_on = time.monotonic() - killed
                log = replacement.log_tail(1_000_000)
                got = re.search(r"state from \S+: (\d+) objects, ([\d.]+) MB downloaded in ([\d.]+) s", log)
                how = f"; it pulled {got.group(2)} MB ({got.group(1)} objects) in {got.group(3)} s" if got else ""
                print(
                    f"model {args.model}, lease {args.lease:g} s: the replacement served {serving:.1f} s after the "
                    f"kill ({attempts} starts, the earlier ones refused for the lease) with round {restored} open, "
                    f"and closed that round {moved_on:.1f} s after the kill{how}"
                )
                for i in islands:
                    i.stop()
                replacement.stop()
        finally:
            from atoll.objects import close_client

            close_client()
            store.stop()


if __name__ == "__main__":
    main()
