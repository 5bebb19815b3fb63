"""DiLoCo against data-parallel training (torch DDP, all-reduce every step) at equal tokens and compute.

    python benchmarks/convergence.py [--steps 240] [--sync-every 30]

Two workers either way, each on its own data stream, the same model init and inner optimizer
(AdamW). DDP: 2 gloo ranks all-reduce gradients every step (bytes = what a ring all-reduce sends
plus receives per rank: 2 x 2 (n-1)/n x gradient bytes per step). DiLoCo: 2 island processes, H
inner steps per round; bytes = what the island clients counted on the wire (push + pull; the
downlink stays identity, so only the uplink shrinks with the codec). Printed: final eval loss,
bytes per worker, and the ratios to DDP. Overlapped and streaming variants (issue 6) are not
implemented yet.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

from atoll.harness.demo import DemoArgs, run_island_group  # noqa: E402


def _ddp_worker(rank: int, world: int, port: int, steps: int, lr: float, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    from atoll.data import CharDataset
    from atoll.islands.runner import evaluate
    from atoll.models import GPTConfig, TinyGPT

    data = CharDataset(block_size=64)
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(TinyGPT(GPTConfig(vocab_size=data.vocab_size)))
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.1, betas=(0.9, 0.95))
    gen = torch.Generator().manual_seed(1000 + rank)
    for _ in range(steps):
        x, y = data.batch(gen, 16)
        _, loss = model(x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    if rank == 0:
        grad_bytes = 4 * sum(p.numel() for p in model.parameters())
        # A ring all-reduce sends and receives 2 (n-1)/n x the gradient per rank per step.
        sent = int(2 * 2 * (world - 1) / world * grad_bytes * steps)
        Path(out).write_text(f"{evaluate(model.module, data)} {sent}")
    dist.destroy_process_group()


def run_ddp(steps: int, lr: float) -> tuple[float, int]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # handed to init_process_group (the OS picked it, nothing guessed)
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "ddp.txt")
        mp.spawn(_ddp_worker, args=(2, port, steps, lr, out), nprocs=2, join=True)
        loss, sent = Path(out).read_text().split()
    return float(loss), int(sent)


def run_diloco(steps: int, h: int, codec: str, ef: bool, lr: float) -> tuple[float, int]:
    args = DemoArgs(rounds=steps // h, sync_every=h, codec=codec, error_feedback=ef, inner_lr=lr)
    with tempfile.TemporaryDirectory() as tmp:
        events, codes = run_island_group(args, Path(tmp), progress=False)
    if codes != [0, 0]:
        raise RuntimeError(f"islands failed: {codes}")
    rounds = [e for e in events if e["event"] == "round"]
    last = max(e["round"] for e in rounds)
    loss = [e["eval_loss"] for e in rounds if e["round"] == last][0]
    per_island = sum(e["bytes_sent"] + e["bytes_received"] for e in rounds) // 2
    return loss, per_island


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=240)
    ap.add_argument("--sync-every", type=int, default=30)
    ap.add_argument("--inner-lr", type=float, default=3e-3)
    args = ap.parse_args()
    ddp_loss, ddp_bytes = run_ddp(args.steps, args.inner_lr)
    rows = [("DDP (all-reduce every step)", ddp_loss, ddp_bytes)]
    for name, codec, ef in [
        ("DiLoCo identity", "identity", False),
        ("DiLoCo int8", "int8", False),
        ("DiLoCo top-k 1% + EF", "topk:fraction=0.01", True),
    ]:
        loss, sent = run_diloco(args.steps, args.sync_every, codec, ef, args.inner_lr)
        rows.append((name, loss, sent))
    print(f"2 workers, {args.steps} inner steps each (batch 16 x 64 tokens), H={args.sync_every}")
    print(f"{'setup':30s} {'eval loss':>9s} {'loss/DDP':>9s} {'bytes/worker':>14s} {'DDP bytes/this':>14s}")
    for name, loss, sent in rows:
        print(f"{name:30s} {loss:9.4f} {loss / ddp_loss:9.3f} {sent:14,d} {ddp_bytes / sent:14.1f}")


if __name__ == "__main__":
    main()
