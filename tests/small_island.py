"""A small island for the tests of resuming, the run's lifecycle and the operator's tools: a two-layer
MLP, fixed batches, a run config of H = 4, and the wrapper around them (not started)."""

from __future__ import annotations

import torch
from conftest import make_diloco

from atoll.coordinator import RunConfig
from atoll.islands._transport.client import RetryPolicy

H = 4


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))


def batches(n: int):
    gen = torch.Generator().manual_seed(3)
    return [(torch.randn(32, 8, generator=gen), torch.randn(32, 4, generator=gen)) for _ in range(n)]


def config(**kw) -> RunConfig:
    kw = {"codec": "identity", "downlink_codec": "identity", **kw}  # exact fp32 arithmetic
    return RunConfig(run_id="t", sync_every=H, outer_lr=0.7, outer_momentum=0.9, **kw)


def island(address, **kw):
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    kw.setdefault("island_id", "solo")
    sync = make_diloco(model, address, run_id="t", retry=RetryPolicy(give_up_seconds=20), **kw)
    return model, opt, sync
