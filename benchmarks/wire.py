"""Push and pull against raw loopback TCP of the same bytes, measured side by side in one run.

    python benchmarks/wire.py [--model gpt-125m|tiny] [--many 2000] [--repeat 3]
                              [--transports bulk grpc bulk-tls grpc-tls]

A real ``atoll coordinator`` process (quorum 1) and this process as one island speaking the
protocol through atoll's own client:

- push: one identity (fp32) push of the whole model, header to answer;
- close -> publish: from the push's answer to the update being pullable (outer step + the round's
  log record), read from the coordinator's round record;
- pull: the round's update (identity, |θ|) once published, request to last byte;
- the floors: the same bytes over one raw loopback TCP stream between two processes, and written
  with fsync to a new file beside the state dir (plain buffered writes, the median of three: what
  "the time to fsync the round's update bytes" is on this disk);
- per tensor: the same pushes and pulls with ``--many`` tensors of 1 KiB each (``--many 0`` skips it);
- each case once per transport: the bulk port (the default) and gRPC (``--bulk-port -1``), in the
  clear or over TLS (``-tls``: a certificate made with ``openssl`` for 127.0.0.1; the island trusts
  it as its CA), one after the other, then their ratios.

Printed: each figure, the median over ``--repeat`` rounds, and push / pull over the TCP floor.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import common
import torch

from atoll.compression import get_codec
from atoll.islands import ClientTls, CoordinatorClient, RetryPolicy
from atoll.protos import coordinator_pb2 as pb


def shapes_of(model: str, many: int) -> dict[str, tuple[int, ...]]:
    if many:
        return {f"t{i}": (256,) for i in range(many)}
    from atoll.models import TinyGPT, preset

    vocab = {"tiny": 65, "gpt-small": 65, "gpt-125m": 50257}[model]
    with torch.device("meta"):
        m = TinyGPT(preset(model, vocab_size=vocab))
    return {k: tuple(p.shape) for k, p in m.named_parameters()}


def tcp_floor(nbytes: int) -> float:
    """Seconds for ``nbytes`` over one loopback TCP stream to another process, until its ack."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    code = (
        "import socket,sys\n"
        f"c=socket.create_connection(('127.0.0.1',{srv.getsockname()[1]}));left={nbytes};b=bytearray(1<<22)\n"
        "while left: left-=c.recv_into(b,min(len(b),left))\n"
        "c.sendall(b'k')\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", code])
    conn, _ = srv.accept()
    payload = memoryview(bytearray(nbytes))
    payload[::4096] = b"x" * len(payload[::4096])  # touched: no page faults in the timed part
    started = time.perf_counter()
    conn.sendall(payload)
    conn.recv(1)
    took = time.perf_counter() - started
    proc.wait()
    conn.close()
    srv.close()
    return took


def rss_kib(pid: int, field: str) -> int:
    """VmRSS (now) or VmHWM (peak) of a process, in KiB."""
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(f"{field}:"))


def disk_floor(nbytes: int, where: Path) -> float:
    """Seconds to write ``nbytes`` to a new file in ``where`` and fsync it (buffered, as the OS does
    by default), the median of three."""
    data = memoryview(bytearray(nbytes))
    took = []
    for i in range(3):
        path = where / f"floor-{i}.bin"
        started = time.perf_counter()
        with open(path, "wb", buffering=0) as f:
            f.write(data)
            os.fsync(f.fileno())
        took.append(time.perf_counter() - started)
        path.unlink()
    return statistics.median(took)


def certificate(where: Path, host: str = "127.0.0.1", *more: str) -> tuple[Path, Path]:
    """A self-signed certificate and key for ``host`` (and the ``more`` addresses the same server is
    reached at; the island takes the certificate as its CA)."""
    cert, key = where / "cert.pem", where / "key.pem"
    names = ",".join(f"IP:{h}" for h in (host, *more))
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes", "-days", "1",
         "-subj", f"/CN={host}", "-addext", f"subjectAltName={names}", "-keyout", str(key), "-out", str(cert)],
        check=True, capture_output=True,
    )  # fmt: skip
    return cert, key


class Island:
    def __init__(self, address: str, shapes, tls: ClientTls | None = None) -> None:
        retry = RetryPolicy(give_up_seconds=60, rpc_timeout_seconds=120)
        self.client = CoordinatorClient(address, retry=retry, tls=tls)
        self.shapes = shapes
        req = pb.JoinRequest(run_id="w", island_id="a", codecs=["identity"], num_ranks=1)
        for name, shape in shapes.items():
            req.tensors.add(name=name, shape=list(shape), dtype=pb.DTYPE_FLOAT32)
        self.client.join(req)

    def push(self, payloads: list, round_: int, kind=pb.PUSH_KIND_DELTA) -> float:
        h = pb.PushHeader(run_id="w", island_id="a", round=round_, kind=kind, rank=0, num_ranks=1, tokens=1)
        h.codec = "identity"
        for name, p in zip(self.shapes, payloads, strict=True):
            h.entries.add(name=name, num_bytes=len(p))
        started = time.perf_counter()
        resp = self.client.push(h, payloads)
        took = time.perf_counter() - started
        assert resp.outcome in (pb.PUSH_OUTCOME_COMMITTED,) or resp.committed, resp
        return took

    def pull(self, have_round: int) -> tuple[float, int]:
        req = pb.PullRequest(run_id="w", island_id="a", have_round=have_round, wait_seconds=60)
        got = [0]

        def on_entry(header, i, payload) -> None:  # as an island takes them: one entry at a time
            got[0] += len(payload)

        started = time.perf_counter()
        header, _ = self.client.pull(req, on_entry=on_entry)
        took = time.perf_counter() - started
        assert header.round == have_round + 1, header
        return took, got[0]


def measure(shapes, repeat: int, tmp: Path, transport: str) -> dict:
    identity = get_codec("identity")
    gen = torch.Generator().manual_seed(0)
    theta = [identity.encode(torch.randn(s, generator=gen)) for s in shapes.values()]
    delta = [identity.encode(torch.randn(s, generator=gen) * 1e-3) for s in shapes.values()]
    tls_flags, tls = [], None
    if transport.endswith("-tls"):
        cert, key = certificate(tmp)
        tls_flags, tls = ["--tls-cert", str(cert), "--tls-key", str(key)], ClientTls(ca=str(cert))
    flags = ["--run-id", "w", "--sync-every", "1", "--quorum", "1", "--grace-window", "off", "--codec", "identity",
             "--downlink-codec", "identity", *(["--bulk-port", "-1"] if transport.startswith("grpc") else []),
             *tls_flags]  # fmt: skip
    with common.Coordinator(tmp / "state", flags, admin=True) as coord:
        start_rss = rss_kib(coord.pid, "VmRSS") * 1024  # serving, before any model is there

        def status() -> dict:
            with urllib.request.urlopen(f"http://127.0.0.1:{coord.admin_port}/api/status", timeout=30) as resp:
                return json.load(resp)

        island = Island(coord.address, shapes, tls)
        assert (island.client.bulk is not None) == transport.startswith("bulk")
        island.push(theta, 0, kind=pb.PUSH_KIND_INIT)
        island.pull(-1)  # θ_0
        pushes, pulls = [], []
        for r in range(repeat + 1):
            pushes.append(island.push(delta, r))
            while status()["round"] <= r:  # published: the pull below is the transfer alone
                time.sleep(0.01)
            took, nbytes = island.pull(r)
            pulls.append(took)
        history = status()["history"][1:]
        closes = [rec["outer_step_seconds"] + rec["persist_seconds"] for rec in history]
        peak_rss = rss_kib(coord.pid, "VmHWM") * 1024
        steps = [rec["outer_step_seconds"] for rec in history]
        island.client.close()
    return {
        "disk": disk_floor(nbytes, tmp),
        "rss": (peak_rss - start_rss) / nbytes,
        "bytes": nbytes,
        "push": statistics.median(pushes[1:]),
        "pull": statistics.median(pulls[1:]),
        "close": statistics.median(closes),
        "step": statistics.median(steps),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="gpt-125m", choices=["tiny", "gpt-small", "gpt-125m"])
    p.add_argument("--many", type=int, default=2000, help="tensors of 1 KiB for the per-tensor case (0: skip)")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument(
        "--transports", nargs="+", default=["bulk", "grpc"], choices=["bulk", "grpc", "bulk-tls", "grpc-tls"]
    )
    a = p.parse_args()
    cases = [(a.model, shapes_of(a.model, 0))] + ([(f"{a.many} x 1 KiB", shapes_of(a.model, a.many))] if a.many else [])
    for name, shapes in cases:
        by = {}
        for transport in a.transports:
            with tempfile.TemporaryDirectory(prefix="wire-") as tmp:
                by[transport] = got = measure(shapes, a.repeat, Path(tmp), transport)
            report(f"{name} [{transport}]", shapes, got)
        for a_, b_ in (("bulk", "grpc"), ("bulk-tls", "bulk"), ("bulk-tls", "grpc-tls"), ("grpc-tls", "grpc")):
            if a_ in by and b_ in by:
                print(
                    f"{name}: {a_} / {b_}: push {by[a_]['push'] / by[b_]['push']:.2f}x, "
                    f"pull {by[a_]['pull'] / by[b_]['pull']:.2f}x",
                    flush=True,
                )


def report(name: str, shapes, got: dict) -> None:
    floor = statistics.median(tcp_floor(got["bytes"]) for _ in range(3))
    print(
        f"{name}: {len(shapes)} tensors, {got['bytes'] / 2**20:.1f} MiB; raw TCP {floor * 1e3:.1f} ms; "
        f"push {got['push'] * 1e3:.1f} ms ({got['push'] / floor:.1f}x TCP), "
        f"pull {got['pull'] * 1e3:.1f} ms ({got['pull'] / floor:.1f}x TCP); "
        f"close -> publish {got['close'] * 1e3:.1f} ms (outer step {got['step'] * 1e3:.1f} ms, then the log "
        f"record {(got['close'] - got['step']) * 1e3:.1f} ms); write + fsync of the update's bytes "
        f"{got['disk'] * 1e3:.1f} ms: close -> publish = {got['close'] / (got['step'] + got['disk']):.2f}x "
        "(outer step + fsync); coordinator peak RSS above its start "
        f"{got['rss']:.1f}|θ| (one push of |θ| in flight at a time)",
        flush=True,
    )


if __name__ == "__main__":
    main()
