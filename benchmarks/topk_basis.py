"""How much of a real pseudo-gradient each sparse codec keeps, on the bundled workload.

    python benchmarks/topk_basis.py [--steps 30] [--fraction 0.01]

Trains the demo's tiny GPT for one round of ``--steps`` inner AdamW steps (the island's settings)
from the demo's initial θ, takes Δ = θ_start − θ_end and, for each codec, prints the share of
``||Δ||²`` its decode keeps (1 − ||Δ − D(C(Δ))||² / ||Δ||², summed over all tensors) and the
bytes of its payloads. Values are fp16 so that the figures show the choice of coefficients,
not the quantisation. Deterministic: one run is the measurement.
"""

from __future__ import annotations

import argparse

import torch

from atoll.compression import get_codec
from atoll.data.dataset import CharDataset
from atoll.models import GPTConfig, TinyGPT


def first_round_delta(steps: int) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)  # the island's default --seed
    data = CharDataset(block_size=64)
    model = TinyGPT(GPTConfig(vocab_size=data.vocab_size, block_size=64))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1, betas=(0.9, 0.95))
    gen = torch.Generator().manual_seed(1)
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    for _ in range(steps):
        x, y = data.batch(gen, 16)
        _, loss = model(x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    return {n: start[n] - p.detach() for n, p in model.named_parameters()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--fraction", type=float, default=0.01)
    args = ap.parse_args()
    delta = first_round_delta(args.steps)
    total = sum(float(d.double().pow(2).sum()) for d in delta.values())
    dense = sum(4 * d.numel() for d in delta.values())
    f = args.fraction
    specs = [
        f"topk:fraction={f:g},values=fp16",
        f"dcttopk:fraction={f:g},values=fp16,chunk=16",
        f"dcttopk:fraction={f:g},values=fp16,chunk=32",
        f"dcttopk:fraction={f:g},values=fp16,chunk=64",
        f"dcttopk:fraction={f:g},values=int8,chunk=64",
        "powersgd:rank=1",
    ]
    print(f"Δ after {args.steps} inner steps: {sum(d.numel() for d in delta.values()):,d} elements, {dense:,d} B fp32")
    print(f"{'codec':45s} {'kept ||Δ||²':>11s} {'payload B':>10s} {'fp32/payload':>12s}")
    for spec in specs:
        codec = get_codec(spec)
        lost, size = 0.0, 0
        for d in delta.values():
            payload = codec.encode(d, {})
            size += len(payload)
            lost += float((d - codec.decode(payload, tuple(d.shape))).double().pow(2).sum())
        print(f"{spec:45s} {1 - lost / total:11.3f} {size:10,d} {dense / size:12.1f}")


if __name__ == "__main__":
    main()
