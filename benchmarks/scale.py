"""The exchange at a real model size: a 124M-parameter GPT's tensors through the real coordinator process.

    python benchmarks/scale.py [--model gpt-125m] [--islands 2,4] [--codecs identity,int8] [--rounds 3]

Each island is its own process running the real DiLoCo wrapper on a model with the preset's tensors
(GPT-2 vocabulary). Between syncs it stands in for H inner steps by moving every parameter by noise
of a realistic size (1e-3 of the parameter's scale), so the pseudo-gradients are dense and
incompressible as a real one is; the coordinator is ``atoll coordinator`` over real gRPC on loopback.

Per round it prints: push (longest island push), outer step, persist and publish (coordinator: the
update handed to the downlink and waiting pulls woken), pull (longest
transfer of the update), bytes up and down. Per configuration: coordinator peak RSS over fp32 |θ|
(above its RSS before θ_0 arrived, and against 5x |θ| plus the peak of the in-flight push budget),
island peak extra host memory over its fp32 shard (above its RSS with the model built), and
close->publish (outer step + persist) over the time of writing the same state bytes with fsync,
measured in the same run on the same disk.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import common  # noqa: F401  (the repository and benchmarks/ on the path: benchmarks/common.py)

MIB = 1 << 20


def status_memory(pid: int) -> dict[str, int]:
    out = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, rest = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                out[key] = int(rest.split()[0]) * 1024
    return out


# ---- the island process ---------------------------------------------------------------------------
def island_main(args) -> None:
    import torch

    from atoll.islands import CoordinatorClient, CoordinatorLink, DiLoCo, RetryPolicy
    from atoll.memory import tune_for_bulk_buffers
    from atoll.models import TinyGPT, preset

    tune_for_bulk_buffers(heap=False)  # as atoll island does
    torch.set_num_threads(1)
    model = TinyGPT(preset(args.model, vocab_size=50257))
    gen = torch.Generator().manual_seed(0)
    noise = torch.zeros(max(p.numel() for p in model.parameters()))  # H inner steps' stand-in (touched now)
    times: dict[str, float] = {}

    class TimedClient(CoordinatorClient):
        """The real client; it times the last push, and the transfer of the last update pulled (from
        its header to its last byte: not the long-poll wait before it)."""

        def open_pull(self, req):
            return TimedPull(super().open_pull(req))

        def push(self, header, payloads):
            started = time.perf_counter()
            try:
                return super().push(header, payloads)
            finally:
                times["push"] = time.perf_counter() - started

    class TimedPull:
        """A pull stream that times its transfer: from its header to its end."""

        def __init__(self, stream) -> None:
            self.stream, self.first, self.entries = stream, None, 0

        def header(self):
            header = self.stream.header()
            self.first, self.entries = time.perf_counter(), len(header.entries)
            return header

        def __getattr__(self, name):  # read_into, confirmation, end: the stream's own
            return getattr(self.stream, name)

        def close(self) -> None:
            self.stream.close()
            if self.entries:
                times["pull"] = time.perf_counter() - self.first

    before = status_memory(os.getpid())["VmRSS"]
    shard_bytes = 4 * sum(p.numel() for p in model.parameters())
    retry = RetryPolicy(give_up_seconds=600, rpc_timeout_seconds=600)
    link = CoordinatorLink(
        args.coordinator, run_id="scale", island_id=args.island_id, connect=lambda a: TimedClient(a, retry=retry)
    )
    sync = DiLoCo(model, link).start()
    for r in range(args.rounds):
        with torch.no_grad():
            for p in model.parameters():  # stands in for H inner steps
                p.add_(noise[: p.numel()].view_as(p).normal_(0, 2e-5, generator=gen))
        stats = sync.sync()
        mem = status_memory(os.getpid())
        print(
            json.dumps(
                {
                    "round": r,
                    "push": times.get("push"),
                    "pull": times.get("pull"),
                    "sent": stats.bytes_sent,
                    "received": stats.bytes_received,
                    "extra_peak": (mem["VmHWM"] - before) / shard_bytes,
                }
            ),
            flush=True,
        )
    sync.close()


# ---- the driver -------------------------------------------------------------------------------------
def reference_write_seconds(directory: Path, num_bytes: int) -> float:
    """Write ``num_bytes`` of tensor data with fsync (the state's size, on the same disk): median of 3."""
    import torch

    data = memoryview(torch.randn(num_bytes // 4).numpy()).cast("B")
    times = []
    for _ in range(3):
        path = directory / "reference.bin"
        started = time.perf_counter()
        with open(path, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        times.append(time.perf_counter() - started)
        path.unlink()
    return statistics.median(times)


def run_config(work: Path, model: str, islands: int, codec: str, rounds: int) -> dict:
    from atoll.harness import ProcessGroup
    from atoll.harness.processes import ManagedProcess

    admin_file = work / "admin.port"
    with ProcessGroup(work) as group:
        coord, address = group.start_coordinator(
            work / "state",
            [
                *("--run-id", "scale", "--sync-every", "1", "--codec", codec, "--quorum", str(islands)),
                *("--downlink-codec", "identity"),
                *("--round-deadline-seconds", "3600", "--lease-seconds", "600", "--keep-snapshots", "1"),
                *("--admin-port", "0", "--admin-port-file", str(admin_file)),
            ],
            timeout=120,
        )
        base = status_memory(coord.pid)["VmRSS"]
        procs = []
        for i in range(islands):
            argv = [sys.executable, __file__, "--island", "--coordinator", address, "--island-id", f"i{i}"]
            argv += ["--model", model, "--rounds", str(rounds)]
            procs.append(ManagedProcess(f"i{i}", argv, work))
            group.processes.append(procs[-1])
        codes = [p.wait(3600) for p in procs]
        if codes != [0] * islands:
            raise RuntimeError(f"islands exited {codes}: {procs[0].log_tail()}")
        coord_mem = status_memory(coord.pid)
        admin = f"http://127.0.0.1:{admin_file.read_text().strip()}/api/status"
        with urllib.request.urlopen(admin, timeout=30) as resp:
            status = json.loads(resp.read())
        island_rounds = [[json.loads(line) for line in p.lines if line.startswith("{")] for p in procs]
        theta_bytes = 4 * status["num_params"]
        ref = reference_write_seconds(work, 2 * theta_bytes)  # θ and momentum: the snapshot's tensors
        coord.stop()
    return {
        "history": status["history"],
        "islands": island_rounds,
        "theta_bytes": theta_bytes,
        "coord_peak_over_theta": (coord_mem["VmHWM"] - base) / theta_bytes,
        "coord_peak_total_over_theta": coord_mem["VmHWM"] / theta_bytes,
        "inflight_peak_over_theta": status["inflight_peak_bytes"] / theta_bytes,
        "inflight_budget_over_theta": status["inflight_budget_bytes"] / theta_bytes,
        "reference_write": ref,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    p.add_argument("--island", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--coordinator", help=argparse.SUPPRESS)
    p.add_argument("--island-id", help=argparse.SUPPRESS)
    p.add_argument("--model", default="gpt-125m", help="model preset (default: gpt-125m, 124M parameters)")
    p.add_argument("--islands", default="2,4", help="island counts to run (default: 2,4)")
    p.add_argument("--codecs", default="identity,int8", help="uplink codecs to run (default: identity,int8)")
    p.add_argument("--rounds", type=int, default=3, help="rounds per configuration (default: 3)")
    args = p.parse_args()
    if args.island:
        island_main(args)
        return
    print(f"{args.model}, rounds {args.rounds}, one coordinator process and N island processes on loopback")
    for codec in args.codecs.split(","):
        for n in (int(x) for x in args.islands.split(",")):
            with tempfile.TemporaryDirectory(prefix="atoll-scale-") as tmp:
                res = run_config(Path(tmp), args.model, n, codec, args.rounds)
            theta = res["theta_bytes"]
            print(f"\n== {codec}, {n} islands, |θ| = {theta / MIB:,.0f} MiB fp32 ({theta // 4:,} parameters)")
            print(
                f"{'round':>5} {'push s':>7} {'outer s':>7} {'persist s':>9} {'publish s':>9} {'pull s':>7}"
                f" {'MB up':>8} {'MB down':>8}"
            )
            closes = []
            for r, h in enumerate(res["history"]):
                rows = [isl[r] for isl in res["islands"] if len(isl) > r]
                push = max(x["push"] or 0 for x in rows)
                pull = max(x["pull"] or 0 for x in rows)
                up = sum(x["sent"] for x in rows) / 1e6
                down = sum(x["received"] for x in rows) / 1e6
                closes.append(h["outer_step_seconds"] + h["persist_seconds"])
                print(
                    f"{r:>5} {push:7.2f} {h['outer_step_seconds']:7.2f} {h['persist_seconds']:9.2f}"
                    f" {h.get('publish_seconds', 0):9.3f} {pull:7.2f}"
                    f" {up:8.1f} {down:8.1f}"
                )
            extra = max(isl[-1]["extra_peak"] for isl in res["islands"])
            close = statistics.median(closes)
            budget = res["inflight_budget_over_theta"]
            print(
                f"coordinator peak RSS: {res['coord_peak_over_theta']:.2f}x |θ| above its start "
                f"({res['coord_peak_total_over_theta']:.2f}x in all); bound 5x + in-flight budget "
                f"{budget:.2f}x = {5 + budget:.2f}x (in flight at most: {res['inflight_peak_over_theta']:.2f}x)"
            )
            print(f"island peak extra host memory: {extra:.2f}x its fp32 shard (bound 2x)")
            print(
                f"close->publish (outer step + persist): median {close:.2f}s; writing the same state bytes with "
                f"fsync: {res['reference_write']:.2f}s; ratio {close / res['reference_write']:.2f}x (bound 3x)"
            )


if __name__ == "__main__":
    main()
