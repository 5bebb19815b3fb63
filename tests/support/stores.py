"""Rounds run against a coordinator whose state is kept in an object store, and that state read back."""

from __future__ import annotations

import torch

from atoll.islands import RetryPolicy
from support.training import make_diloco


def run_rounds(srv, rounds: int, seed: int = 0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    sync = make_diloco(model, srv.address, island_id="a", retry=RetryPolicy(give_up_seconds=20)).start()
    try:
        gen = torch.Generator().manual_seed(seed)
        while sync.round < rounds:
            loss = model(torch.randn(4, 8, generator=gen)).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            sync.step(tokens=4, loss=loss.item())
    finally:
        sync.close()


def state_of(srv):
    def grab(s):
        return (
            s.round,
            {k: v.clone() for k, v in s.model.params.items()},
            {k: v.clone() for k, v in s.model.state_tensors().items()},
            [dict(h) for h in s.ledger.history],
        )

    return srv.inspect(grab)
