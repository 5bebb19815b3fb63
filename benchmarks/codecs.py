"""Codec throughput beside a memcpy measured in the same run.

    python benchmarks/codecs.py [--numel 67108864] [--repeat 3] [--specs int8 topk:fraction=0.01]

For each codec: encode and decode GB/s (fp32 bytes of the tensor per second), each as a ratio to
a plain memcpy of the same tensor into a preallocated buffer (best of ``--repeat``, measured
interleaved with the codec so machine noise hits both), compression ratio and relative error
||x - x_hat|| / ||x||; last, each codec's encode and decode-add time against int8's, and the
coordinator's path for one push entry (validated as it arrives, then added into the sum without a
second check: ``verified=True``) against int8's, and for the codecs that write a weighted payload
(the first contribution to a tensor of the sum), that write against zeroing the tensor and adding. Encode
reuses its payload buffer across calls (as an island does every round); "decode" is
decode-and-accumulate into an fp32 buffer (the coordinator's path); "dec(new)" allocates its
output, to show what fresh pages cost on this machine.

The process applies :func:`atoll.memory.tune_for_bulk_buffers` first, as ``atoll island`` and
the daemon do (huge pages for large buffers); ``ATOLL_MALLOC_TUNING=0`` measures without it.
"""

from __future__ import annotations

import argparse
import os
import time

import torch

from atoll.compression import get_codec
from atoll.memory import THP_ENV, tune_for_bulk_buffers

DEFAULT_SPECS = [
    "identity",
    "fp16",
    "bf16",
    "int8",
    "int4",
    "int2",
    "topk:fraction=0.01",
    "dcttopk:fraction=0.01",
    "powersgd:rank=4",
    "sparse",
]


def best(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--numel", type=int, default=64 * 1024 * 1024)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--specs", nargs="*", default=DEFAULT_SPECS, help="codec specs to measure")
    args = ap.parse_args()
    tuned = tune_for_bulk_buffers()  # as `atoll island` and the daemon do, before any tensor exists
    specs = args.specs
    n = args.numel
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(n, generator=gen) * torch.rand(n, generator=gen)  # uneven magnitudes, like a delta
    side = 1 << (n.bit_length() // 2)
    mat_shape = (side, n // side) if side * (n // side) == n else (1, n)
    nbytes = 4 * n
    dst = torch.empty_like(x)
    acc = torch.zeros_like(x)
    thp = os.environ.get(THP_ENV, "0") != "0"
    print(
        f"tensor: {n:,d} fp32 elements ({nbytes / 2**20:.0f} MiB), torch threads {torch.get_num_threads()}, "
        f"mallopt tuning {'on' if tuned else 'off'}, huge pages {'on' if thp else 'off'}"
    )
    print(
        f"{'codec':32s} {'memcpy GB/s':>11s} {'enc GB/s':>9s} {'enc/memcpy':>10s} {'dec GB/s':>9s} "
        f"{'dec/memcpy':>10s} {'dec(new)/memcpy':>15s} {'ratio':>8s} {'rel err':>9s}"
    )
    k = n // 100
    t_copy = best(lambda: dst.copy_(x), args.repeat)
    t_full = best(lambda: torch.topk(x.abs(), k, sorted=False), 1)
    print(
        f"{'torch.topk 1% (whole tensor)':32s} {nbytes / t_copy / 1e9:11.2f} {nbytes / t_full / 1e9:9.2f} "
        f"{t_copy / t_full:10.3f}",
        flush=True,
    )
    times = {spec: measure(spec, x, dst, acc, mat_shape, args.repeat) for spec in specs}
    if "int8" in times:  # each codec's encode and decode-add against int8's, both measured in this run
        e8, d8, c8 = times["int8"]
        print("against int8: " + ", ".join(f"{s} {e / e8:.2f}x / {d / d8:.2f}x" for s, (e, d, _) in times.items()))
        print(
            "the coordinator's path (validate, then decode-add verified), ms and against int8: "
            + ", ".join(f"{s} {c * 1e3:.1f} ms {c / c8:.2f}x" for s, (_, _, c) in times.items())
        )


def measure(
    spec: str, x: torch.Tensor, dst: torch.Tensor, acc: torch.Tensor, mat_shape, repeat: int
) -> tuple[float, float, float]:
    """Prints the codec's row; returns its encode, decode-add and coordinator-path seconds."""
    nbytes = 4 * x.numel()
    codec = get_codec(spec)
    t_in = x.view(mat_shape) if spec.startswith(("powersgd", "dcttopk")) else x  # both work on matrices
    shape = tuple(t_in.shape)
    state: dict = {}
    buf = codec.encode(t_in, state)  # warm-up (and PowerSGD's first Q); reused like an island does
    t_copy = best(lambda: dst.copy_(x), repeat)
    t_enc = best(lambda: codec.encode(t_in, state, out=buf), repeat)
    payload = codec.encode(t_in, state)
    t_copy2 = best(lambda: dst.copy_(x), repeat)
    acc_view = acc.view(shape)
    t_dec = best(lambda: codec.decode_add_(payload, acc_view), repeat)
    t_new = best(lambda: codec.decode(payload, shape), repeat)

    def arrive_and_add() -> None:
        codec.validate(payload, shape)
        codec.decode_add_(payload, acc_view, verified=True)

    t_path = best(arrive_and_add, repeat)
    t_mem = min(t_copy, t_copy2)
    y = codec.decode(payload, shape).reshape(-1)
    rel = float((x - y).norm() / x.norm())
    mem = nbytes / t_mem / 1e9
    print(
        f"{spec:32s} {mem:11.2f} {nbytes / t_enc / 1e9:9.2f} {t_mem / t_enc:10.3f} {nbytes / t_dec / 1e9:9.2f} "
        f"{t_mem / t_dec:10.3f} {t_mem / t_new:15.3f} {nbytes / len(payload):8.1f} {rel:9.2e}",
        flush=True,
    )
    if codec.writes_weighted:  # the first contribution to a tensor of the sum (a weight of 0.37)
        t_write = best(lambda: codec.write_weighted_(payload, acc_view, alpha=0.37, verified=True), repeat)

        def zero_then_add() -> None:
            acc_view.zero_()
            codec.decode_add_(payload, acc_view, alpha=0.37, verified=True)

        t_zero = best(zero_then_add, repeat)
        print(f"{'':32s} first contribution: written {t_write * 1e3:.1f} ms, zeroed and added {t_zero * 1e3:.1f} ms "
              f"({t_write / t_zero:.2f}x)", flush=True)  # fmt: skip
    return t_enc, t_dec, t_path


if __name__ == "__main__":
    main()
