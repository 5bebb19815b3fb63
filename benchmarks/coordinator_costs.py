"""The coordinator's own work in an exchange, per parameter, on one thread: what ``atoll plan`` counts.

    python benchmarks/coordinator_costs.py [--model gpt-125m] [--codecs identity int8 int4 dcttopk]
                                           [--downlinks int8 identity] [--repeat 3] [--threads 1]
                                           [--sum-density 1.0] [--relays int8 identity]

- **decode**: one island's push decoded into the round's sum, as the coordinator does it when the
  push commits (``decode_add_`` of every tensor, the payloads already checked: ``verified=True``),
  under its lock, so the islands' pushes decode one after the other;
- **outer step**: the round's outer step (mean, Nesterov, the downlink's encoding) with θ_{r+1}'s
  finiteness check and each payload sent to the round's log record as it is made
  (:class:`~atoll.coordinator.disk.wal.RecordStream`, in a temporary directory), as
  ``GlobalModel.step`` runs it in the daemon; the record's writes finishing after the step (the
  daemon's ``persist_seconds``, :data:`atoll.plan.RECORD_SECONDS`) and the sum's fresh copy for the
  next run are left out of the time.

- **relay**: a relay's own work in a round besides decoding its islands' pushes: their mean encoded
  with its error feedback, and the update it pulls applied to its θ with the payload kept to serve
  (:data:`atoll.plan.RELAY_SECONDS_PER_PARAM`).

The outer step's sum holds random values; ``--sum-density D`` keeps a random D of them and zeroes
the rest: the sum of N pushes of a codec that keeps a share s of each holds at most N·s nonzeros
(three ``sparse`` pushes: 3/128), and a top-k downlink's encoding of such a sum costs less (at 124M
on one thread, a ``sparse`` downlink's step 1.18 s at 3/128 against 1.92 s dense).

Each the median of ``--repeat`` runs after a warm-up, in seconds and in ns per parameter; the last
line is the figures as ``atoll plan``'s constants take them (:data:`atoll.plan.DECODE_SECONDS_PER_PARAM`,
:data:`atoll.plan.OUTER_SECONDS_PER_PARAM`). The daemon's own figures, per round, are in its history
records (``decode_seconds``, ``outer_step_seconds``: ``/api/status``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time

import torch
from common import MODEL_VOCAB, model_theta  # benchmarks/common.py (and the repository on the path)

from atoll.compression import get_codec
from atoll.coordinator.disk import wal
from atoll.coordinator.state.outer import FiniteTheta, NesterovSGD, outer_step_
from atoll.memory import tune_for_bulk_buffers


def timed(work, repeat: int, after=None) -> float:
    """The median seconds of ``work()`` (``after()`` runs after each, untimed)."""
    times = []
    for i in range(repeat + 1):
        began = time.perf_counter()
        work()
        if i:  # the first faults its buffers in
            times.append(time.perf_counter() - began)
        if after is not None:
            after()
    return statistics.median(times)


def decode_seconds(theta: dict[str, torch.Tensor], spec: str, repeat: int) -> float:
    codec = get_codec(spec)
    gen = torch.Generator().manual_seed(1)
    payloads = {n: codec.encode((torch.randn(t.shape, generator=gen) * 1e-3).contiguous()) for n, t in theta.items()}
    sums = {n: torch.zeros_like(t) for n, t in theta.items()}

    def run() -> None:
        for n, payload in payloads.items():
            codec.decode_add_(payload, sums[n], alpha=0.5, verified=True)

    return timed(run, repeat)


def outer_seconds(theta: dict[str, torch.Tensor], spec: str, repeat: int, density: float = 1.0) -> float:
    shapes = {n: tuple(t.shape) for n, t in theta.items()}
    codec, finite = get_codec(spec), FiniteTheta()
    opt = NesterovSGD(shapes, lr=0.7, momentum=0.9, nesterov=True)
    ef = {n: torch.zeros(s) for n, s in shapes.items()}
    gen = torch.Generator().manual_seed(2)
    sums = {n: torch.randn(s, generator=gen) * 1e-3 for n, s in shapes.items()}
    if density < 1.0:  # what the sum of pushes that keep few values holds
        sums = {n: t * (torch.rand(t.shape, generator=gen) < density) for n, t in sums.items()}
    params = {n: t.clone() for n, t in theta.items()}
    spares: dict = {}
    sizes = {n: codec.encoded_size(s) for n, s in shapes.items()}
    with tempfile.TemporaryDirectory(prefix="coord-costs-") as tmp:
        rounds, streams = iter(range(10**6)), []
        accums = []

        def run() -> None:
            nonlocal spares
            accum = accums.pop()
            stream = wal.RecordStream(tmp, next(rounds), wal.head_hint(sizes, dict, []) or 0)
            streams.append(stream)
            payloads = outer_step_(
                accum,
                params,
                weight_total=2.0,
                optimizer=opt,
                buffers=frozenset(),
                downlink=codec,
                downlink_ef=ef,
                downlink_state={},
                spares=spares,
                made=stream.add,
            )
            for n, payload in payloads.items():
                finite.check(n, params[n], accum[n], payload, codec)
            spares = dict(payloads)

        def drain() -> None:  # the record's writes finish after the step, as in the daemon (untimed)
            streams.pop().abandon()
            accums.append({n: t.clone() for n, t in sums.items()})

        accums.append({n: t.clone() for n, t in sums.items()})
        return timed(run, repeat, after=drain)


def relay_seconds(theta: dict[str, torch.Tensor], spec: str, repeat: int) -> tuple[float, float]:
    """A relay's own work in a round besides decoding its islands' pushes (:mod:`atoll.relay.link`):
    the mean of their sum encoded in the run's codec ``spec`` with its error feedback
    (:func:`~atoll.relay.link.encode_mean`), and the update pulled in ``spec``'s downlink applied to θ as
    an island applies it, its payload kept to serve (``RelayUpstream._apply``): (seconds, seconds)."""
    from atoll.compression import codec_of
    from atoll.plan import downlink_for
    from atoll.relay.link import encode_mean

    codec, down = get_codec(spec), get_codec(downlink_for(spec))
    gen = torch.Generator().manual_seed(3)
    sums = {n: torch.randn(t.shape, generator=gen) * 1e-3 for n, t in theta.items()}
    ef: dict[str, dict] = {}  # (its error feedback's state, by tensor)
    fresh = []

    def encode() -> None:
        encode_mean(fresh.pop(), 2.0, codec, ef)

    def refill() -> None:
        fresh.append({n: t.clone() for n, t in sums.items()})

    refill()
    encoded = timed(encode, repeat, after=refill)
    updates = {n: down.encode((t * 1e-3).contiguous()) for n, t in sums.items()}
    out = {n: torch.empty_like(t) for n, t in theta.items()}

    def apply() -> None:
        for n, payload in updates.items():
            out[n].copy_(theta[n])
            codec_of(payload).add_decoded_(payload, out[n])
            bytearray(payload)

    return encoded, timed(apply, repeat)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="gpt-125m", choices=sorted(MODEL_VOCAB))
    p.add_argument("--codecs", nargs="*", default=["identity", "int8", "int4", "dcttopk"])
    p.add_argument("--downlinks", nargs="*", default=["int8", "identity"])
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--threads", type=int, default=1, help="torch threads (the daemon's --threads)")
    p.add_argument("--sum-density", type=float, default=1.0, help="the share of the outer step's sum that is nonzero")
    p.add_argument("--relays", nargs="*", default=["int8", "identity"], help="codecs to time a relay's own work in")
    a = p.parse_args()
    tune_for_bulk_buffers()
    torch.set_num_threads(a.threads)
    theta = model_theta(a.model)
    numel = sum(t.numel() for t in theta.values())
    print(f"{a.model}: {numel:,} parameters, {torch.get_num_threads()} torch thread(s)", flush=True)
    decode, outer = {}, {}
    for spec in a.codecs:
        s = decode_seconds(theta, spec, a.repeat)
        decode[spec] = s / numel
        print(f"  decode of one {spec} push into the sum: {s:.3f} s ({s / numel * 1e9:.2f} ns/param)", flush=True)
    for spec in a.downlinks:
        s = outer_seconds(theta, spec, a.repeat, a.sum_density)
        outer[spec] = s / numel
        print(f"  outer step, {spec} downlink, record streamed: {s:.3f} s ({s / numel * 1e9:.2f} ns/param)", flush=True)
    relay = {}
    for spec in a.relays:
        encoded, applied = relay_seconds(theta, spec, a.repeat)
        relay[spec] = (encoded + applied) / numel
        print(
            f"  a relay's own work, {spec}: its mean encoded {encoded:.3f} s, the update applied {applied:.3f} s "
            f"({relay[spec] * 1e9:.2f} ns/param together)",
            flush=True,
        )
    print(json.dumps({"decode_seconds_per_param": decode, "outer_seconds_per_param": outer,
                      "relay_seconds_per_param": relay}))  # fmt: skip


if __name__ == "__main__":
    main()
