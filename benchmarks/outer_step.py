"""The coordinator's outer step, a chunk at a time against a tensor at a time, in one run.

    python benchmarks/outer_step.py [--model gpt-125m] [--codecs int8 identity] [--repeat 5] [--threads 2]
                                    [--finite-check] [--workers N]

For each downlink codec: the same round's outer step (mean of the pushes, Nesterov, downlink error
feedback, encode, θ_{r+1}) over the preset's tensors, made chunk by chunk as the codec reads it
(``outer_step_`` with a codec that reads its input in chunks) and tensor by tensor (the same codec
made to read its input whole), interleaved run by run so machine noise hits both; the median of
``--repeat`` rounds after a warm-up each, their ratio, and whether the two gave the same bits.
The process applies :func:`atoll.memory.tune_for_bulk_buffers` first, as the daemon does.
``--finite-check``: instead, the chunked step followed by the coordinator's check that θ_{r+1} is
finite (:class:`~atoll.coordinator.state.outer.FiniteTheta`, as ``GlobalModel.step`` does it, the first
round's measurement of θ left out), against the step alone: what the check costs. ``--workers N``:
instead, the chunked step on N tensor workers (:class:`~atoll.coordinator.state.workers.TensorWorkers`,
several tensors at once) against one tensor after another, both with ``--threads`` torch threads.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from common import MODEL_VOCAB, model_theta  # benchmarks/common.py (and the repository on the path)

from atoll.compression import get_codec
from atoll.coordinator.state.outer import FiniteTheta, NesterovSGD, outer_step_
from atoll.coordinator.state.workers import TensorWorkers
from atoll.memory import tune_for_bulk_buffers


class Whole:
    """A codec made to read its input whole: the outer step's tensor-at-a-time path."""

    chunked_input = False

    def __init__(self, codec) -> None:
        self._codec = codec

    def __getattr__(self, name):
        return getattr(self._codec, name)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="gpt-125m", choices=sorted(MODEL_VOCAB))
    p.add_argument("--codecs", nargs="+", default=["int8", "identity"])
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--finite-check", action="store_true", help="the step with and without θ's finiteness check")
    p.add_argument("--workers", type=int, default=0, help="the step on this many tensor workers against one")
    a = p.parse_args()
    tune_for_bulk_buffers()
    if a.threads:
        torch.set_num_threads(a.threads)
    theta = model_theta(a.model)
    shapes = {n: tuple(t.shape) for n, t in theta.items()}
    numel = sum(t.numel() for t in theta.values())
    print(f"{a.model}: {len(shapes)} tensors, {numel:,} parameters, {torch.get_num_threads()} torch threads")
    gen = torch.Generator().manual_seed(1)
    sums = {n: torch.randn(s, generator=gen) * 1e-3 for n, s in shapes.items()}
    for spec in a.codecs:
        paths = {"chunks": get_codec(spec), "whole": Whole(get_codec(spec))}
        if a.finite_check:
            paths = {"checked": get_codec(spec), "unchecked": get_codec(spec)}
        if a.workers:
            paths = {"workers": get_codec(spec), "serial": get_codec(spec)}
        pools = {k: TensorWorkers(a.workers if k == "workers" else 1) for k in paths}
        opts = {k: NesterovSGD(shapes, lr=0.7, momentum=0.9, nesterov=True) for k in paths}
        state = {k: (opts[k], {n: torch.zeros(s) for n, s in shapes.items()}) for k in paths}
        spares = {k: {} for k in paths}
        times = {k: [] for k in paths}
        made = {}
        finite = FiniteTheta()
        for r in range(a.repeat + 1):
            for k in paths if r % 2 == 0 else reversed(list(paths)):
                accum = {n: t.clone() for n, t in sums.items()}
                opt, ef = state[k]
                started = time.perf_counter()
                payloads = outer_step_(
                    accum,
                    theta,
                    weight_total=2.0,
                    optimizer=opt,
                    buffers=frozenset(),
                    downlink=paths[k],
                    downlink_ef=ef,
                    downlink_state={},
                    spares=spares[k],
                    workers=pools[k],
                )
                if k == "checked":
                    for n, payload in payloads.items():
                        finite.check(n, theta[n], accum[n], payload, paths[k])
                if r:  # the first round of each faults its buffers in
                    times[k].append(time.perf_counter() - started)
                spares[k] = dict(payloads)
                made[k] = (accum, payloads)
            first, second = paths
            same = all(torch.equal(made[first][0][n], made[second][0][n]) for n in shapes) and all(
                bytes(made[first][1][n]) == bytes(made[second][1][n]) for n in shapes
            )
            if not same:
                raise SystemExit(f"{spec}: the two paths differ in round {r}")
        one, two = (statistics.median(times[k]) for k in (first, second))
        what = {
            "chunks": "outer step a chunk at a time",
            "whole": "a tensor at a time",
            "checked": "outer step with θ's finiteness check",
            "unchecked": "without it",
            "workers": f"outer step on {a.workers} tensor workers",
            "serial": "on one",
        }
        print(
            f"[{spec}] {what[first]} {one * 1e3:.0f} ms, {what[second]} {two * 1e3:.0f} ms: "
            f"{one / two:.2f}x (runs: {', '.join(f'{t * 1e3:.0f}' for t in times[first])} against "
            f"{', '.join(f'{t * 1e3:.0f}' for t in times[second])} ms); the same bits every round"
        )


if __name__ == "__main__":
    main()
