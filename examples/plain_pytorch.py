"""Bring your own model: a plain PyTorch training loop as a DiLoCo island.

Start a coordinator, then one process per island (each with its own --island-id):

    atoll coordinator --state-dir /tmp/atoll-example --port 7070 --run-id example --sync-every 20 --quorum 2 &
    python examples/plain_pytorch.py --coordinator 127.0.0.1:7070 --island-id site-a &
    python examples/plain_pytorch.py --coordinator 127.0.0.1:7070 --island-id site-b

The model learns a fixed nonlinear function of its input; each island sees its own samples. The last
line printed is JSON: the island's final loss and a digest of its parameters (equal on every island).
"""

from __future__ import annotations

import argparse
import hashlib
import json

import torch

from atoll.islands import CoordinatorLink, DiLoCo, IslandCheckpoint, Preempted


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    p.add_argument("--coordinator", required=True, help="host:port of the coordinator")
    p.add_argument("--island-id", required=True, help="this island's name in the run")
    p.add_argument("--run-id", default="example", help="the coordinator's --run-id")
    p.add_argument("--steps", type=int, default=100, help="inner steps to train")
    p.add_argument("--checkpoint-dir", help="checkpoint here at each push; a restart resumes exactly")
    args = p.parse_args()

    torch.manual_seed(0)  # θ_0 comes from whichever island bootstraps; the seed only fixes the model's shape
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.Linear(64, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    target = torch.nn.Sequential(torch.nn.Linear(16, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))  # the function
    data = torch.Generator().manual_seed(int(hashlib.sha256(args.island_id.encode()).hexdigest()[:8], 16))

    # `with` leaves the run on the way out, also on Ctrl-C, SIGTERM (Preempted) or an exception.
    link = CoordinatorLink(args.coordinator, run_id=args.run_id, island_id=args.island_id)
    ckpt = None
    if args.checkpoint_dir:  # model, AdamW, DiLoCo's state, RNG, and this loop's data position
        ckpt = IslandCheckpoint(
            args.checkpoint_dir,
            model,
            opt,
            state=lambda: {"data": data.get_state()},
            load_state=lambda s: data.set_state(s["data"]),
        )
    sync = DiLoCo(model, link, before_push=ckpt.save if ckpt else None)  # the push waits for the write
    if ckpt is not None:
        ckpt.load(sync)  # the newest complete checkpoint, if any: a restarted island resumes where it was
    with sync:
        try:
            train(sync, model, opt, target, data, args.steps)
        except Preempted:  # SIGTERM: checkpoint where we stand, then leave the run and exit 143
            if ckpt is not None:
                ckpt.save(sync)()
            raise
        first, last = (sync.history[0].global_loss, sync.history[-1].global_loss) if sync.history else (None, None)
    digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in model.parameters())).hexdigest()
    print(json.dumps({"island": args.island_id, "first_loss": first, "last_loss": last, "digest": digest}))


def train(sync: DiLoCo, model, opt, target, data: torch.Generator, steps: int) -> None:
    while sync.inner_steps < steps:
        x = torch.randn(64, 16, generator=data)
        with torch.no_grad():
            y = target(x)
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        # tokens: what this step processed (here, samples); it weighs the island's delta in the mean.
        sync.step(tokens=x.shape[0], loss=loss.item())
        if sync.run_complete:  # the coordinator's --total-rounds was reached
            break
    sync.drain()  # apply an exchange still in flight (with overlap_steps)


if __name__ == "__main__":
    main()
