"""Does TCP believe the emulated link? The round trip and the rate one TCP stream measures across it.

    python benchmarks/netlink_check.py [--links 100:100 1000:50] [--seconds 10] [--loss 0]

Runs itself under ``unshare -rn`` (a network namespace of its own), builds each link of
:mod:`atoll.harness.netlink` (``RATE_MBIT:RTT_MS``), and across it, from the site's namespace to this
one: 30 one-byte ping-pongs on a TCP connection (the round trip an application sees: median and
minimum), then one TCP stream sending for about ``--seconds`` at the link's rate. The receiver times
it; the rate printed is over the second half of the bytes (after slow start), and over the whole.
The figures: each measured against its setting, and the kernel's own smoothed RTT of the stream
(``TCP_INFO``'s ``tcpi_rtt``, sampled at the end: the round trip with the queue the stream built).
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

import common  # noqa: F401  (the repository and benchmarks/ on the path: benchmarks/common.py)

from atoll.harness.netlink import Link, LinkSpec, enter_namespace

CLIENT = r"""
import json, socket, struct, sys, time
host, port, nbytes = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
c = socket.create_connection((host, port))
c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
rtts = []
for _ in range(30):
    t = time.perf_counter(); c.sendall(b"p"); assert c.recv(1) == b"p"; rtts.append(time.perf_counter() - t)
c.sendall(struct.pack("!Q", nbytes))
buf = memoryview(bytearray(1 << 20)); left = nbytes
while left:
    left -= c.send(buf[: min(len(buf), left)])
assert c.recv(1) == b"k"
info = c.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 104)
srtt_us = struct.unpack_from("I", info, 68)[0]  # tcpi_rtt
print(json.dumps({"rtts": rtts, "srtt_ms": srtt_us / 1e3}))
"""


def serve(listener: socket.socket, got: dict) -> None:
    conn, _ = listener.accept()
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    for _ in range(30):
        conn.sendall(conn.recv(1))
    (nbytes,) = struct.unpack("!Q", conn.recv(8, socket.MSG_WAITALL))
    buf = memoryview(bytearray(1 << 20))
    received, marks = 0, []
    while received < nbytes:
        n = conn.recv_into(buf)
        if not n:
            break
        received += n
        marks.append((time.perf_counter(), received))
    conn.sendall(b"k")
    got.update(nbytes=received, marks=marks)
    conn.close()


def check(rate_mbit: float, rtt_ms: float, seconds: float, loss: float, tuned: bool = True) -> dict:
    spec = LinkSpec(rate_mbit=rate_mbit, rtt_ms=rtt_ms, loss=loss, tuned_buffers=tuned)
    nbytes = int(rate_mbit * 1e6 / 8 * seconds)
    with Link(spec) as link:
        listener = socket.create_server((link.coordinator_host, 0))
        got: dict = {}
        server = threading.Thread(target=serve, args=(listener, got))
        server.start()
        out = subprocess.run(
            link.site_command([sys.executable, "-c", CLIENT, link.coordinator_host, str(listener.getsockname()[1]),
                               str(nbytes)]),
            capture_output=True, text=True, timeout=seconds * 10 + 60,
        )  # fmt: skip
        server.join()
        listener.close()
        if out.returncode != 0:
            raise RuntimeError(out.stderr)
    client = json.loads(out.stdout)
    marks = got["marks"]
    half = next(i for i, (_, n) in enumerate(marks) if n >= nbytes / 2)
    t0, n0 = marks[half]
    t1, n1 = marks[-1]
    steady = (n1 - n0) * 8 / (t1 - t0) / 1e6
    whole = n1 * 8 / (t1 - marks[0][0]) / 1e6
    rtt = statistics.median(client["rtts"]) * 1e3
    return {
        "rate_mbit": rate_mbit,
        "rtt_ms": rtt_ms,
        "loss": loss,
        "ping_rtt_ms": rtt,
        "ping_rtt_min_ms": min(client["rtts"]) * 1e3,
        "stream_srtt_ms": client["srtt_ms"],
        "steady_mbit": steady,
        "whole_mbit": whole,
        "bytes": n1,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--links", nargs="+", default=["100:100", "1000:50"], help="RATE_MBIT:RTT_MS each")
    p.add_argument("--seconds", type=float, default=10.0)
    p.add_argument("--loss", type=float, default=0.0)
    p.add_argument("--default-buffers", action="store_true", help="keep the kernel's TCP buffer limits")
    a = p.parse_args()
    enter_namespace([str(Path(__file__).resolve()), *sys.argv[1:]])
    for link in a.links:
        rate, rtt = (float(x) for x in link.split(":"))
        r = check(rate, rtt, a.seconds, a.loss, tuned=not a.default_buffers)
        print(
            f"{rate:g} Mbit/s, {rtt:g} ms, loss {a.loss:g}, {'default' if a.default_buffers else 'tuned'} TCP "
            f"buffers: ping RTT median {r['ping_rtt_ms']:.1f} ms "
            f"({r['ping_rtt_ms'] / rtt:.3f}x the setting; min {r['ping_rtt_min_ms']:.1f}); one TCP stream "
            f"{r['steady_mbit']:.1f} Mbit/s over its second half ({r['steady_mbit'] / rate:.3f}x the rate), "
            f"{r['whole_mbit']:.1f} over the whole {r['bytes'] / 1e6:.0f} MB (slow start included); "
            f"its smoothed RTT at the end {r['stream_srtt_ms']:.1f} ms",
            flush=True,
        )
        print(json.dumps(r), flush=True)


if __name__ == "__main__":
    main()
