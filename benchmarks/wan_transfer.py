"""A push and a pull at 124M across an emulated WAN link, over one TCP stream and striped over several.

    python benchmarks/wan_transfer.py [--link 1000:80] [--model gpt-125m] [--codec int8]
                                      [--streams 1 4 8] [--repeat 2] [--tls] [--tuned-buffers]
                                      [--connections fresh kept] [--idle 2] [--keep-window]
                                      [--admission eager wait]

Runs itself under ``unshare -rn`` and builds one link of :mod:`atoll.harness.netlink`
(``RATE_MBIT:RTT_MS``; the hosts' TCP buffers left at the kernel's defaults unless ``--tuned-buffers``).
A real ``atoll coordinator`` (quorum 1, ``--codec`` both ways) listens on this side; one island
process in the site's namespace joins, uploads θ_0, then for each stream count pushes a
pseudo-gradient (``--codec``) and pulls the round's update, ``--repeat`` times each, through atoll's
own client (``bulk_streams``), ``--idle`` seconds of (replayed) compute before each push. ``fresh``:
every call opens its connections (handshakes, slow start); ``kept``: calls reuse the connections of
the calls before (one untimed push and pull first), as an island does round after round when the
coordinator keeps them. ``--keep-window``: both hosts keep their congestion window over idle time
(``net.ipv4.tcp_slow_start_after_idle=0``). ``--admission``: a push's data goes right behind its
header (``eager``, an island's first attempt) or once the coordinator admitted it (``wait``, a retry's;
every push before `bulk.EAGER`); with both, each repeat does one of each, side by side. Printed per
stream count, connection mode and admission: the median push and pull, header to answer (connections,
TLS and admission included), and the rate each moved its payload at against the link's.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import common  # the repository and benchmarks/ on the path (benchmarks/common.py)

from atoll.harness.netlink import Link, LinkSpec, enter_namespace

ROOT = common.ROOT


def island(
    address: str,
    model: str,
    codec: str,
    streams: list[int],
    repeat: int,
    ca: str,
    modes: list[str],
    idle: float,
    admissions: list[str],
) -> None:
    """The site's side (run in its namespace): prints one JSON line of timings."""
    import torch

    from atoll.compression import get_codec
    from atoll.harness.transfers import drop_connections, push_after_admission
    from atoll.islands import ClientTls, CoordinatorClient, RetryPolicy
    from atoll.models import TinyGPT, preset
    from atoll.protos import coordinator_pb2 as pb

    vocab = {"tiny": 65, "gpt-125m": 50257}[model]
    with torch.device("meta"):
        shapes = {k: tuple(p.shape) for k, p in TinyGPT(preset(model, vocab_size=vocab)).named_parameters()}
    tls = ClientTls(ca=ca) if ca else None
    client = CoordinatorClient(address, retry=RetryPolicy(give_up_seconds=120, rpc_timeout_seconds=300), tls=tls)
    req = pb.JoinRequest(run_id="w", island_id="a", codecs=[codec], num_ranks=1)
    for name, shape in shapes.items():
        req.tensors.add(name=name, shape=list(shape), dtype=pb.DTYPE_FLOAT32)
    client.join(req)
    gen = torch.Generator().manual_seed(0)
    enc = get_codec(codec)

    def push(payloads, round_, kind, spec, admission="eager") -> float:
        h = pb.PushHeader(run_id="w", island_id="a", round=round_, kind=kind, num_ranks=1, tokens=1, codec=spec)
        for name, p in zip(shapes, payloads, strict=True):
            h.entries.add(name=name, num_bytes=len(p))
        started = time.perf_counter()
        # An eager push's first attempt goes without waiting for admission; the other waits a round trip.
        resp = client.push(h, payloads) if admission == "eager" else push_after_admission(client, h, payloads)
        assert resp.committed or resp.outcome == pb.PUSH_OUTCOME_COMMITTED, resp
        return time.perf_counter() - started

    def pull(have: int) -> tuple[float, int, float]:
        """The pull's time, its bytes, and the rate its entries came in after the first half of them."""
        marks = [(time.perf_counter(), 0)]

        def took(h, i, p) -> None:
            marks.append((time.perf_counter(), marks[-1][1] + len(p)))

        header, _ = client.pull(
            pb.PullRequest(run_id="w", island_id="a", have_round=have, wait_seconds=120), on_entry=took
        )
        assert header.round == have + 1
        total = marks[-1][1]
        t_half, n_half = next(m for m in marks if m[1] >= total / 2)
        rate = (total - n_half) / (marks[-1][0] - t_half) if marks[-1][0] > t_half else 0.0
        return marks[-1][0] - marks[0][0], total, rate

    identity = get_codec("identity")
    client.bulk_streams = max(streams)  # θ_0 (fp32) as fast as the link allows
    push([identity.encode(torch.randn(s, generator=gen)) for s in shapes.values()], 0, pb.PUSH_KIND_INIT, "identity")
    delta = [enc.encode(torch.randn(s, generator=gen) * 1e-3) for s in shapes.values()]
    out, round_ = {"push_bytes": sum(map(len, delta)), "rtt": client.rtt}, 0
    joined = client.bulk
    for n in streams:
        client.bulk_streams = n
        for mode in modes:
            drop_connections(client)  # each mode starts from no connections
            client.bulk = joined if mode == "kept" else dataclasses.replace(joined, keep_seconds=0)
            if mode == "kept":  # connections up and warm, as after a run's first round
                time.sleep(idle)
                push(delta, round_, pb.PUSH_KIND_DELTA, codec)
                pull(round_)
                round_ += 1
            pushes, pulls, rates = ({a: [] for a in admissions} for _ in range(3))
            for _ in range(repeat):
                for admission in admissions:
                    time.sleep(idle)  # the inner steps
                    pushes[admission].append(push(delta, round_, pb.PUSH_KIND_DELTA, codec, admission))
                    took, nbytes, rate = pull(round_)
                    pulls[admission].append(took)
                    rates[admission].append(rate)
                    round_ += 1
            for admission in admissions:
                out[f"{n}/{mode}/{admission}"] = {
                    "push": statistics.median(pushes[admission]),
                    "pull": statistics.median(pulls[admission]),
                    "pull_bytes": nbytes,
                    "pull_second_half_rate": statistics.median(rates[admission]),
                }
    client.close()
    print(json.dumps(out), flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--link", default="1000:80", help="RATE_MBIT:RTT_MS")
    p.add_argument("--model", default="gpt-125m", choices=["tiny", "gpt-125m"])
    p.add_argument("--codec", default="int8")
    p.add_argument("--streams", type=int, nargs="+", default=[1, 4, 8])
    p.add_argument("--repeat", type=int, default=2)
    p.add_argument("--tls", action="store_true", help="serve and connect over TLS (a self-signed certificate)")
    p.add_argument("--tuned-buffers", action="store_true", help="raise the hosts' TCP buffers to 4x the BDP")
    p.add_argument("--connections", nargs="+", choices=["fresh", "kept"], default=["fresh", "kept"])
    p.add_argument("--idle", type=float, default=2.0, help="seconds of replayed compute before each push")
    p.add_argument("--keep-window", action="store_true", help="net.ipv4.tcp_slow_start_after_idle=0 on both hosts")
    p.add_argument(
        "--admission", nargs="+", choices=["eager", "wait"], default=["eager"], help="a push's data before admission"
    )
    p.add_argument("--island", nargs=2, metavar=("ADDRESS", "CA"), help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.island:
        island(a.island[0], a.model, a.codec, a.streams, a.repeat, a.island[1], a.connections, a.idle, a.admission)
        return
    enter_namespace([str(Path(__file__).resolve()), *sys.argv[1:]])
    rate, rtt = (float(x) for x in a.link.split(":"))
    with (
        tempfile.TemporaryDirectory(prefix="wan-") as tmp,
        Link(
            LinkSpec(rate_mbit=rate, rtt_ms=rtt, tuned_buffers=a.tuned_buffers, slow_start_after_idle=not a.keep_window)
        ) as link,
    ):
        tmp = Path(tmp)
        tls_flags, ca = [], ""
        if a.tls:
            from wire import certificate  # benchmarks/wire.py, beside this script

            cert, key = certificate(tmp, link.coordinator_host)
            tls_flags, ca = ["--tls-cert", str(cert), "--tls-key", str(key)], str(cert)
        port_file = tmp / "port"
        coord = subprocess.Popen(
            [sys.executable, "-m", "atoll", "coordinator", "--host", link.coordinator_host, "--port", "0",
             "--port-file", str(port_file), "--state-dir", str(tmp / "state"), "--run-id", "w", "--sync-every", "1",
             "--quorum", "1", "--grace-window", "off", "--codec", a.codec, "--downlink-codec", a.codec,
             "--log-level", "WARNING", *tls_flags],
            cwd=ROOT,
        )  # fmt: skip
        try:
            while not port_file.exists():
                if coord.poll() is not None:
                    raise RuntimeError(f"the coordinator exited with {coord.returncode}")
                time.sleep(0.05)
            time.sleep(0.2)
            address = f"{link.coordinator_host}:{port_file.read_text().strip()}"
            cmd = [sys.executable, str(Path(__file__).resolve()), "--model", a.model, "--codec", a.codec,
                   "--repeat", str(a.repeat), "--streams", *map(str, a.streams), "--idle", str(a.idle),
                   "--connections", *a.connections, "--admission", *a.admission, "--island", address, ca]  # fmt: skip
            out = subprocess.run(link.site_command(cmd), capture_output=True, text=True, timeout=1800)
            if out.returncode != 0:
                raise RuntimeError(out.stderr[-4000:])
            got = json.loads(out.stdout.strip().splitlines()[-1])
        finally:
            coord.terminate()
            coord.wait(30)
    nbytes = got["push_bytes"]
    print(
        f"{a.model} {a.codec} push of {nbytes / 1e6:.1f} MB over {rate:g} Mbit/s, {rtt:g} ms "
        f"({'tuned' if a.tuned_buffers else 'default'} TCP buffers{', TLS' if a.tls else ''}"
        f"{', windows kept over idle time' if a.keep_window else ''}; {a.idle:g} s before each push; "
        f"the island measured "
        f"a round trip of {got['rtt'] * 1e3:.1f} ms); the payload alone at the link's rate takes "
        f"{nbytes * 8 / rate / 1e6:.2f} s",
        flush=True,
    )
    for n, mode, adm in ((n, mode, adm) for n in a.streams for mode in a.connections for adm in a.admission):
        r = got[f"{n}/{mode}/{adm}"]
        print(
            f"  {n} stream{'s' if n > 1 else ' '}, {mode:5}, {adm:5}: push {r['push']:.2f} s "
            f"({nbytes * 8 / r['push'] / 1e6 / rate:.2f} "
            f"of the link's rate), pull of {r['pull_bytes'] / 1e6:.1f} MB {r['pull']:.2f} s "
            f"({r['pull_bytes'] * 8 / r['pull'] / 1e6 / rate:.2f} of it; its second half of the bytes at "
            f"{r['pull_second_half_rate'] * 8 / 1e6 / rate:.2f} of it)",
            flush=True,
        )
    print(json.dumps({"link": a.link, "tls": a.tls, **got}), flush=True)


if __name__ == "__main__":
    main()
