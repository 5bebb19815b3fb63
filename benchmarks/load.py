"""32 lightweight simulated islands pushing concurrently to one coordinator process.

    python benchmarks/load.py [--islands 32] [--numel 1048576] [--rounds 3]

Each simulated island is a thread with its own gRPC channel that pushes a pre-encoded identity
payload every round and long-polls for the update. Reported: ingest throughput (payload bytes the
coordinator accepted per second of push phase), beside a raw loopback TCP transfer of the same
bytes over the same number of concurrent connections measured in this run; and the coordinator's
peak RSS (VmHWM) against its RSS before the load.
"""

from __future__ import annotations

import argparse
import functools
import os
import socket
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import common  # noqa: F401  (the repository and benchmarks/ on the path: benchmarks/common.py)
import torch

from atoll.compression import get_codec
from atoll.harness import ProcessGroup
from atoll.islands import CoordinatorClient, RetryPolicy
from atoll.memory import tune_for_bulk_buffers
from atoll.protos import coordinator_pb2 as pb


def rss_kib(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far (all its threads)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def raw_tcp_seconds(num_conns: int, payload: bytes, rounds: int) -> float:
    srv = socket.create_server(("127.0.0.1", 0))
    srv.listen(num_conns)
    port = srv.getsockname()[1]
    total = len(payload) * rounds

    def sink(conn):
        with conn:
            got = 0
            while got < total:
                got += len(conn.recv(1 << 20))
            conn.sendall(b"k")

    def accept():
        for _ in range(num_conns):
            conn, _ = srv.accept()
            threading.Thread(target=sink, args=(conn,), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()

    def send():
        with socket.create_connection(("127.0.0.1", port)) as s:
            for _ in range(rounds):
                s.sendall(payload)
            s.recv(1)

    threads = [threading.Thread(target=send) for _ in range(num_conns)]
    t = time.perf_counter()
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    dt = time.perf_counter() - t
    srv.close()
    return dt


def released_together(targets: list[Callable[[], object]], pids: tuple[int, ...] = ()) -> tuple[float, list[float]]:
    """Run each target on its own thread, all released at once by a barrier.

    Returns the seconds from the release until the last one finished, and the CPU seconds each
    process in ``pids`` used in that window. If any target raised, raises (after all finished).
    """
    barrier = threading.Barrier(len(targets) + 1)
    errors: list[BaseException] = []

    def go(fn):
        barrier.wait()
        try:
            fn()
        except Exception as err:  # noqa: BLE001 - re-raised below, on the caller's thread
            errors.append(err)

    threads = [threading.Thread(target=go, args=(fn,)) for fn in targets]
    for th in threads:
        th.start()
    barrier.wait()
    t, cpu = time.perf_counter(), [cpu_seconds(p) for p in pids]
    for th in threads:
        th.join()
    seconds = time.perf_counter() - t
    cpu = [cpu_seconds(p) - c for p, c in zip(pids, cpu, strict=True)]
    if errors:
        raise RuntimeError(f"{len(errors)} of {len(targets)} failed: {errors[0]}") from errors[0]
    return seconds, cpu


def _bare_grpc_sink(port_queue) -> None:
    """A grpc.aio server whose one client-streaming method counts the raw bytes it is sent."""
    import asyncio

    import grpc

    from atoll.protos.rpc import SERVER_OPTIONS as GRPC_OPTIONS

    tune_for_bulk_buffers(huge_pages=False)  # as the coordinator does

    async def serve():
        async def push(it, context):
            n = 0
            async for chunk in it:
                n += len(chunk)
            return n.to_bytes(8, "little")

        handler = grpc.method_handlers_generic_handler(
            "bare.Sink", {"Push": grpc.stream_unary_rpc_method_handler(push)}
        )  # no (de)serializers: the chunks stay raw bytes, as atoll's raw chunk path sends them
        server = grpc.aio.server(options=GRPC_OPTIONS)
        server.add_generic_rpc_handlers((handler,))
        port_queue.put(server.add_insecure_port("127.0.0.1:0"))
        await server.start()
        await server.wait_for_termination()

    asyncio.run(serve())


def bare_grpc_seconds(num_conns: int, payload: bytes, rounds: int) -> float:
    """The transport alone: the same chunks over gRPC to a server that does nothing with them."""
    import multiprocessing

    import grpc

    from atoll.protos.rpc import CHUNK_BYTES
    from atoll.protos.rpc import CLIENT_OPTIONS as GRPC_OPTIONS

    ctx = multiprocessing.get_context("spawn")
    ports = ctx.Queue()
    sink = ctx.Process(target=_bare_grpc_sink, args=(ports,), daemon=True)
    sink.start()
    try:
        port = ports.get(timeout=60)
        channels = [grpc.insecure_channel(f"127.0.0.1:{port}", options=GRPC_OPTIONS) for _ in range(num_conns)]
        calls = [ch.stream_unary("/bare.Sink/Push") for ch in channels]
        view = memoryview(payload)

        def chunks():
            for start in range(0, len(view), CHUNK_BYTES):
                yield bytes(view[start : start + CHUNK_BYTES])

        for call in calls:  # connect and warm up, untimed
            call(chunks(), timeout=60)

        def send(call):
            if int.from_bytes(call(chunks(), timeout=60), "little") != len(payload):
                raise RuntimeError("the bare gRPC sink counted the wrong number of bytes")

        seconds = 0.0
        for _ in range(rounds):
            seconds += released_together([functools.partial(send, c) for c in calls])[0]
        for ch in channels:
            ch.close()
        return seconds
    finally:
        sink.kill()
        sink.join(10)


def run(islands: int, numel: int, rounds: int, work: Path) -> dict:
    payload = get_codec("identity").encode(torch.randn(numel))
    with ProcessGroup(work) as group:
        coord, address = group.start_coordinator(
            work / "state",
            ["--run-id", "load", "--sync-every", "1", "--quorum", str(islands), "--round-deadline-seconds", "600"]
            + ["--codec", "identity", "--downlink-codec", "identity"],
        )
        rss_before = rss_kib(coord.pid, "VmRSS")
        clients = [CoordinatorClient(address, retry=RetryPolicy(give_up_seconds=60)) for _ in range(islands)]
        for i, c in enumerate(clients):
            req = pb.JoinRequest(run_id="load", island_id=f"sim-{i}", codecs=["identity"], num_ranks=1)
            req.tensors.add(name="w", shape=[numel], dtype=pb.DTYPE_FLOAT32)
            resp = c.join(req)
            if resp.bootstrap:
                h = pb.PushHeader(
                    run_id="load", island_id=f"sim-{i}", round=0, kind=pb.PUSH_KIND_INIT, num_ranks=1, codec="identity"
                )
                h.entries.add(name="w", num_bytes=len(payload))
                c.push(h, [payload])
        push_seconds = coord_cpu = own_cpu = 0.0
        for r in range(rounds):
            pushes = []
            for i, c in enumerate(clients):
                h = pb.PushHeader(
                    run_id="load",
                    island_id=f"sim-{i}",
                    round=r,
                    kind=pb.PUSH_KIND_DELTA,
                    num_ranks=1,
                    tokens=1,
                    codec="identity",
                )
                h.entries.add(name="w", num_bytes=len(payload))
                pushes.append(functools.partial(c.push, h, [payload]))
            seconds, (c_coord, c_own) = released_together(pushes, pids=(coord.pid, os.getpid()))
            push_seconds += seconds
            coord_cpu += c_coord
            own_cpu += c_own
            header, _ = clients[0].pull(pb.PullRequest(run_id="load", island_id="sim-0", have_round=r, wait_seconds=30))
            if header.round != r + 1:
                raise RuntimeError(f"round {r} did not close: {header}")
        peak = rss_kib(coord.pid, "VmHWM")
        for c in clients:
            c.close()
        coord.stop()
    from atoll.coordinator.disk import snapshots

    hist = snapshots.load(work / "state").history
    return {
        "payload": len(payload),
        "push_seconds": push_seconds,
        "coordinator_cpu_seconds": coord_cpu,
        "islands_cpu_seconds": own_cpu,
        "rss_before_kib": rss_before,
        "peak_kib": peak,
        "rounds_completed": len(hist),
        "islands_per_round": [len(h["islands"]) for h in hist],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--islands", type=int, default=32)
    ap.add_argument("--numel", type=int, default=1 << 20)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument(
        "--default-malloc", action="store_true", help="keep glibc's defaults here (the coordinator tunes its own)"
    )
    args = ap.parse_args()
    if not args.default_malloc:
        tune_for_bulk_buffers()  # what `atoll island` does in its own process
    with tempfile.TemporaryDirectory() as tmp:
        res = run(args.islands, args.numel, args.rounds, Path(tmp))
    total = res["payload"] * args.islands * args.rounds
    tcp = raw_tcp_seconds(args.islands, b"\0" * res["payload"], args.rounds)
    bare = bare_grpc_seconds(args.islands, b"\0" * res["payload"], args.rounds)
    ingest, raw, transport = total / res["push_seconds"] / 1e9, total / tcp / 1e9, total / bare / 1e9
    print(
        f"{args.islands} islands x {args.rounds} rounds x {res['payload'] / 2**20:.1f} MiB payloads "
        f"({total / 2**20:.0f} MiB in all); rounds completed {res['rounds_completed']}, islands per round "
        f"{res['islands_per_round']}"
    )
    print(f"ingest {ingest:.3f} GB/s, raw loopback TCP {raw:.3f} GB/s, ratio {ingest / raw:.3f}")
    print(
        f"bare gRPC stream of the same chunks (server discards them) {transport:.3f} GB/s = "
        f"{transport / raw:.3f}x raw TCP; ingest = {ingest / transport:.3f}x the bare gRPC stream"
    )
    print(
        f"CPU during the push phases ({res['push_seconds']:.2f} s): coordinator "
        f"{res['coordinator_cpu_seconds']:.2f} s, simulated islands {res['islands_cpu_seconds']:.2f} s "
        f"({os.cpu_count()} cores)"
    )
    growth = (res["peak_kib"] - res["rss_before_kib"]) / 1024
    print(
        f"coordinator RSS before {res['rss_before_kib'] / 1024:.0f} MiB, peak {res['peak_kib'] / 1024:.0f} MiB "
        f"(+{growth:.0f} MiB; all islands' payloads of one round = {res['payload'] * args.islands / 2**20:.0f} MiB)"
    )


if __name__ == "__main__":
    main()
