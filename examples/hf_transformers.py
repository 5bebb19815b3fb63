"""Bring your own model: a Hugging Face transformers training loop as a DiLoCo island.

A GPT-2 architecture at a tiny size, randomly initialised (nothing is downloaded), trained on the
text bundled with atoll, byte by byte. Start a coordinator, then one process per island:

    atoll coordinator --state-dir /tmp/atoll-hf --port 7070 --run-id hf --sync-every 10 --quorum 2 &
    python examples/hf_transformers.py --coordinator 127.0.0.1:7070 --island-id site-a &
    python examples/hf_transformers.py --coordinator 127.0.0.1:7070 --island-id site-b

Needs ``pip install transformers`` (atoll's dev extra has it). The last line printed is JSON: the
first and last global loss and a digest of the parameters (equal on every island).
"""

from __future__ import annotations

import argparse
import hashlib
import json

import torch
from transformers import GPT2Config, GPT2LMHeadModel

from atoll.data import bundled_text
from atoll.islands import CoordinatorLink, DiLoCo


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    p.add_argument("--coordinator", required=True, help="host:port of the coordinator")
    p.add_argument("--island-id", required=True, help="this island's name in the run")
    p.add_argument("--run-id", default="hf", help="the coordinator's --run-id")
    p.add_argument("--steps", type=int, default=60, help="inner steps to train")
    p.add_argument("--context", type=int, default=64, help="tokens per sequence")
    args = p.parse_args()

    torch.manual_seed(0)
    config = GPT2Config(vocab_size=256, n_positions=args.context, n_embd=64, n_layer=2, n_head=4)
    model = GPT2LMHeadModel(config)  # random init: no download
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    data = torch.tensor(list(bundled_text().encode("utf-8")), dtype=torch.long)
    sampler = torch.Generator().manual_seed(int(hashlib.sha256(args.island_id.encode()).hexdigest()[:8], 16))

    link = CoordinatorLink(args.coordinator, run_id=args.run_id, island_id=args.island_id)
    with DiLoCo(model, link) as sync:
        first = last = None
        model.train()
        for _ in range(args.steps):
            starts = torch.randint(len(data) - args.context, (16,), generator=sampler)
            batch = torch.stack([data[s : s + args.context] for s in starts.tolist()])
            loss = model(input_ids=batch, labels=batch).loss  # the model shifts the labels itself
            opt.zero_grad()
            loss.backward()
            opt.step()
            stats = sync.step(tokens=batch.numel(), loss=loss.item())
            if stats is not None:
                first = first if first is not None else stats.global_loss
                last = stats.global_loss
            if sync.run_complete:
                break
    digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in model.parameters())).hexdigest()
    print(json.dumps({"island": args.island_id, "first_loss": first, "last_loss": last, "digest": digest}))


if __name__ == "__main__":
    main()
