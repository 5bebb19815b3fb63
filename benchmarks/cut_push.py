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
import tempfile
import time
from pathlib import Path

import common
import torch

from atoll.compression import get_codec
from atoll.harness.transfers import push_cut_and_retried
from atoll.islands import CoordinatorClient, RetryPolicy
from atoll.models import TinyGPT, preset
from atoll.protos import coordinator_pb2 as pb


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
    names = list(shapes)
    flags = ["--run-id", "c", "--sync-every", "1", "--quorum", "1", "--grace-window", "off", "--codec", a.codec]
    with tempfile.TemporaryDirectory(prefix="cut-") as tmp, common.Coordinator(Path(tmp) / "state", flags) as coord:
        client = CoordinatorClient(
            coord.address,
            retry=RetryPolicy(give_up_seconds=60, rpc_timeout_seconds=120, initial_backoff_seconds=0.05),
            bulk_streams=a.streams,
        )
        client.join(common.join_request("c", "a", shapes, [a.codec]))
        client.push(common.push_header("c", "a", 0, pb.PUSH_KIND_INIT, "identity", names, theta), theta)
        started = time.perf_counter()
        assert client.push(common.push_header("c", "a", 0, pb.PUSH_KIND_DELTA, a.codec, names, delta), delta).committed
        whole = time.perf_counter() - started
        client.pull(pb.PullRequest(run_id="c", island_id="a", have_round=0, wait_seconds=60), on_entry=lambda *_: None)

        h = common.push_header("c", "a", 1, pb.PUSH_KIND_DELTA, a.codec, names, delta)
        started = time.perf_counter()
        resp, again = push_cut_and_retried(client, h, delta, a.cut, a.streams)
        took = time.perf_counter() - started
        assert resp.committed, resp
        client.close()
    print(
        f"{a.model} {a.codec} push of {total / 1e6:.1f} MB, cut at {a.cut:.0%} ({a.streams} stream(s)): the retry "
        f"sent {again / 1e6:.1f} MB again = {again / total:.1%} of the payload (before resumable pushes: "
        f"100%); cut attempt + retry {took:.2f} s (0.2 s of it waiting) against "
        f"{whole:.2f} s uninterrupted",
        flush=True,
    )


if __name__ == "__main__":
    main()
