"""What ``sync.step()`` costs between syncs, beside a plain training loop in the same run.

    python benchmarks/overhead.py [--steps 300] [--repeat 5]

A real coordinator process with H larger than the run, so no step syncs: the loop with
``sync.step(tokens, loss)`` after each inner step against the same loop without it, interleaved
(best of ``--repeat`` for each) on the reference model.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import common  # noqa: F401  (the repository and benchmarks/ on the path: benchmarks/common.py)
import torch

from atoll.data import CharDataset
from atoll.harness import ProcessGroup
from atoll.islands import CoordinatorLink, DiLoCo
from atoll.models import GPTConfig, TinyGPT

IDENTITY = ("--codec", "identity", "--downlink-codec", "identity")
"""As its recorded figures were measured (the run's default is int8 both ways)."""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(1)
    data = CharDataset(block_size=64)
    torch.manual_seed(0)
    model = TinyGPT(GPTConfig(vocab_size=data.vocab_size))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(0)
    batches = [data.batch(gen, 16) for _ in range(args.steps)]

    def loop(sync) -> float:
        t = time.perf_counter()
        for x, y in batches:
            _, loss = model(x, y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            if sync is not None:
                sync.step(tokens=x.numel(), loss=loss.item())
            else:
                loss.item()  # the same host sync the wrapped loop does
        return time.perf_counter() - t

    with tempfile.TemporaryDirectory() as tmp, ProcessGroup(Path(tmp)) as group:
        flags = ["--run-id", "ov", "--sync-every", "1000000000", *IDENTITY]
        coord, address = group.start_coordinator(Path(tmp) / "state", flags)
        sync = DiLoCo(model, CoordinatorLink(address, run_id="ov", island_id="ov")).start()
        loop(None)  # warm-up
        plain, wrapped = [], []
        for i in range(args.repeat):  # alternate the order so drift hits both
            if i % 2:
                plain.append(loop(None))
                wrapped.append(loop(sync))
            else:
                wrapped.append(loop(sync))
                plain.append(loop(None))
        n = 100_000  # the call alone, without the training step around it
        t = time.perf_counter()
        for _ in range(n):
            sync.step(tokens=1024, loss=1.0)
        call_us = (time.perf_counter() - t) / n * 1e6
        sync.close()
        coord.stop()
    p, w = min(plain), min(wrapped)
    per_step = p / args.steps
    print(f"{args.steps} inner steps, best of {args.repeat}: plain {p:.3f} s, with sync.step() {w:.3f} s")
    print(
        f"inner step {per_step * 1e3:.2f} ms; loop difference {(w - p) / args.steps * 1e6:.1f} us/step "
        f"= {(w - p) / p:+.2%} of an inner step (machine noise included)"
    )
    print(f"sync.step() alone: {call_us:.2f} us per call = {call_us * 1e-6 / per_step:.4%} of an inner step")


if __name__ == "__main__":
    main()
