"""A 124M push cut part way, then retried: what goes on the wire again.

    python benchmarks/cut_push.py [--model gpt-125m] [--codec int8] [--cut 0.9] [--streams 1]

A real ``atoll coordinator`` (quorum 1) on loopback and this process as one island (atoll's own client
on the bulk port). After θ_0, one push of a pseudo-gradient (``--codec``) goes uninterrupted (round 0);
the next (round 1) is cut once ``--cut`` of its bytes are on the wire (the connection is shut), and
retried as an island retries. Printed: the bytes the retry sent against the payload, and the time of
the cut attempt plus the retry against the uninterrupted push.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from atoll.compression import get_codec  # noqa: E402
from atoll.harness.cuts import reset  # noqa: E402
from atoll.islands._transport.client import CoordinatorClient, RetryPolicy  # noqa: E402
from atoll.islands._transport.streams import TcpPush, _End  # noqa: E402
from atoll.islands._transport.transfer import write_push  # noqa: E402
from atoll.models import TinyGPT, preset  # noqa: E402
from atoll.protos import coordinator_pb2 as pb  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="gpt-125m", choices=["tiny", "gpt-125m"])
    p.add_argument("--codec", default="int8")
    p.add_argument("--cut", type=float, default=0.9)
    p.add_argument("--streams", type=int, default=1)
    a = p.parse_args()
    vocab = {"tiny": 65, "gpt-125m": 50257}[a.model]
    with torch.device("meta"):
        shapes = {k: tuple(t.shape) for k, t in TinyGPT(preset(a.model, vocab_size=vocab)).named_parameters()}
    gen = torch.Generator().manual_seed(0)
    codec = get_codec(a.codec)
    theta = [get_codec("identity").encode(torch.randn(s, generator=gen)) for s in shapes.values()]
    delta = [codec.encode(torch.randn(s, generator=gen) * 1e-3) for s in shapes.values()]
    total = sum(map(len, delta))
    with tempfile.TemporaryDirectory(prefix="cut-") as tmp:
        port_file = Path(tmp) / "port"
        coord = subprocess.Popen(
            [sys.executable, "-m", "atoll", "coordinator", "--port", "0", "--port-file", str(port_file),
             "--state-dir", str(Path(tmp) / "state"), "--run-id", "c", "--sync-every", "1", "--quorum", "1",
             "--grace-window", "off", "--codec", a.codec, "--log-level", "WARNING"],
            cwd=ROOT,
        )  # fmt: skip
        try:
            while not port_file.exists():
                time.sleep(0.05)
            time.sleep(0.2)
            client = CoordinatorClient(
                f"127.0.0.1:{port_file.read_text().strip()}",
                retry=RetryPolicy(give_up_seconds=60, rpc_timeout_seconds=120, initial_backoff_seconds=0.05),
                bulk_streams=a.streams,
            )
            req = pb.JoinRequest(run_id="c", island_id="a", codecs=[a.codec], num_ranks=1)
            for name, shape in shapes.items():
                req.tensors.add(name=name, shape=list(shape), dtype=pb.DTYPE_FLOAT32)
            client.join(req)

            def header(round_, kind, spec, payloads):
                h = pb.PushHeader(run_id="c", island_id="a", round=round_, kind=kind, num_ranks=1, tokens=1)
                h.codec = spec
                for name, pl in zip(shapes, payloads, strict=True):
                    h.entries.add(name=name, num_bytes=len(pl))
                return h

            client.push(header(0, pb.PUSH_KIND_INIT, "identity", theta), theta)
            started = time.perf_counter()
            assert client.push(header(0, pb.PUSH_KIND_DELTA, a.codec, delta), delta).committed
            whole = time.perf_counter() - started
            client.pull(
                pb.PullRequest(run_id="c", island_id="a", have_round=0, wait_seconds=60), on_entry=lambda *_: None
            )

            h = header(1, pb.PUSH_KIND_DELTA, a.codec, delta)
            started = time.perf_counter()
            stream = TcpPush(client.bulk, h, auth="", timeout=60, streams=a.streams)
            left = int(total * a.cut)
            for pl in delta:
                take = min(len(pl), left)
                if take > 0:
                    stream.send(memoryview(pl)[:take])
                left -= take
            stream._ready.put(_End)  # every byte of the cut attempt on the wire, then the cut
            stream._sender.join()
            for sock in stream._socks:
                reset(sock)  # as a link that dies: no orderly end
            time.sleep(0.2)  # the coordinator sees the connection end
            retry = client.open_push(h)
            resp = write_push(retry, h, delta)
            took = time.perf_counter() - started
            assert resp.committed, resp
            again = total - retry.resumed_from
            client.close()
        finally:
            coord.terminate()
            coord.wait(30)
    print(
        f"{a.model} {a.codec} push of {total / 1e6:.1f} MB, cut at {a.cut:.0%} ({a.streams} stream(s)): the retry "
        f"resumed at byte {retry.resumed_from:,} and sent {again / 1e6:.1f} MB again = {again / total:.1%} of the "
        f"payload (before resumable pushes: 100%); cut attempt + retry {took:.2f} s (0.2 s of it waiting) against "
        f"{whole:.2f} s uninterrupted",
        flush=True,
    )


if __name__ == "__main__":
    main()
